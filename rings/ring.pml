/*
 * The ring protocol of rings/core.py (peers), rings/tickets.py and rings/repair.py (the host's
 * repairs), as a Promela model that spin searches exhaustively. Run it through
 *
 *   python -m scripts.chaos.check_ring_model [--long]     (tests/integration/test_ring_model.py: quick set)
 *
 * or by hand: spin -DFIRST_ITEMS=1 -a rings/ring.pml && gcc -O1 -DSAFETY -DCOLLAPSE -o pan
 * pan.c && ./pan -m100000.
 *
 * Modelled: NPROD producers and NCONS consumers (peer ids 1..NPROD, then the consumers), a
 * ring of CAP slots; FAA tickets on tail / head; the per-slot stamps; the peers' seat words;
 * the payload (which item, framed for which position); the orphan hint; and the host:
 * revoke-then-repair of a dead peer (claims tombstoned / freed, declared tickets given up),
 * the ticket scan with its two-scan rule for undeclared tickets, the give-up CASes, and the
 * claim timeout giving up a live but idle peer's ready declared ticket (at any moment,
 * MAX_IDLE times per run). Each step names the Python function it mirrors.
 *
 * Steps: a peer's round trip (BEGIN V(..) V(..) END) is one atomic step by default: the tcp
 * and local transports, whose host runs a whole batch under the region lock. -DPER_VERB makes
 * every verb its own step: the rdma transport, where others act between a batch's verbs. Any
 * peer may crash before any step (MAX_CRASHES times per run); none of its later verbs runs,
 * which is also what a peer revoked for a claim timeout looks like to the ring. The host
 * notices a crash (the connection drops) at any later moment. The host's view (counters,
 * stamps, seats) is one step, as on tcp and local; the rdma host's three ordered reads are
 * argued in rings/tickets.py.
 *
 * Waiting blocks here (a guard on the awaited slot changing) where the Python code returns
 * None / False and polls again, so a ring that stops flowing is a deadlock: spin reports it
 * as an invalid end state.
 *
 * Properties. Assertions: an item is claimed at most once; a claimed slot holds the item
 * published for that position, unchanged until read (a stray write would show); the claims
 * the protocol says cannot fail do not (above all the producer's claim + payload + publish
 * batch after it saw FREE(p) for its own ticket while TAKING: that is the write that must
 * never land in a slot someone else owns); a live claimer's publish or free always finds its
 * own claim (never repaired behind its back). And no invalid end state: every peer that did
 * not crash finishes, which for the consumers means every item was claimed unless its
 * producer crashed before publishing it (see `resolved`).
 *
 * Negative variants (the test expects spin to find an error in each):
 *   -DBROKEN_POP    an orphan is claimed by a read and a write instead of one CAS
 *   -DBROKEN_WATCH  the host gives an undeclared ticket up at once, without the two-scan rule
 */

/* Stamp states: the names and values of rings/layout.py SlotState (a test compares them). */
#define FREE 0
#define CLAIMED_PUSH 1
#define PUBLISHED 2
#define CLAIMED_POP 3
#define TOMBSTONE 4
#define ORPHANED 5
/* Seat kinds: rings/layout.py SeatKind. */
#define IDLE 0
#define TAKING 1
#define HOLDS 2

#ifndef CAP
#define CAP 2
#endif
#ifndef NPROD
#define NPROD 2
#endif
#ifndef NCONS
#define NCONS 2
#endif
/* Items: producer 1 pushes FIRST_ITEMS, every other producer one; three in all by default,
 * enough for the 2-slot ring to wrap (and fill: a ticket a lap ahead of its slot). */
#ifndef FIRST_ITEMS
#define FIRST_ITEMS 2
#endif
#ifndef MAX_CRASHES
#define MAX_CRASHES 1
#endif
#ifndef MAX_IDLE
#define MAX_IDLE 1
#endif
#define ITEMS (FIRST_ITEMS + NPROD - 1)
#define ITEMS_OF(me) ((me) == 1 -> FIRST_ITEMS : 1)
#define FIRST_ITEM_OF(me) ((me) == 1 -> 1 : FIRST_ITEMS + (me) - 1)
#define NPEER (NPROD + NCONS)
#define NPOS 10
#define PUSH 0
#define POP 1

/* stamp = position * 64 + holder * 8 + state (rings/layout.py: position << 24 | holder << 4
 * | state, scaled down); holder 0 is nobody. */
#define ST(p, h, s) ((p) * 64 + (h) * 8 + (s))
#define SPOS(w) ((w) / 64)
#define SHOLD(w) (((w) / 8) % 8)
#define SSTATE(w) ((w) % 8)
/* seat = value * 4 + kind (rings/layout.py seat()). */
#define SEAT(k, v) ((v) * 4 + (k))
#define SKIND(w) ((w) % 4)
#define SVAL(w) ((w) / 4)

short stamp[CAP];          /* rings/layout.py initial_region: slot i FREE(i) */
byte pay_item[CAP];        /* payload: which item (0: none) ... */
byte pay_pos[CAP];         /* ... framed for which position (rings/payload.py frame) */
byte head;
byte tail;
byte hint;                 /* header orphan_hint: 1 + an ORPHANED position, 0: none */
short seat[2 * (NPEER + 1)];   /* seat[2 * peer + side] */

byte crashes = MAX_CRASHES;
bool dead[NPEER + 1];      /* crashed (or revoked by a timeout: the same to the ring) */
bool revoked[NPEER + 1];   /* the host has noticed: RingHost.revoke ran */
byte unnoticed;            /* peers dead but not yet revoked */
bit dirty;                 /* the region changed since the host's last scan */
/* TicketWatch._was_taking: a bit per live peer TAKING on a side at the previous scan (kept
 * only while some position of that side was undeclared then). */
byte was_taking[2];
/* A peer that was TAKING at the previous scan has written its seat since. TicketWatch
 * compares (peer, seq) with the previous scan's; a peer never writes TAKING(seq) twice, so
 * "no longer that TAKING(seq)" is "written since", and the model keeps this bit instead of
 * sequence numbers (which then need not be modelled). Set only for a peer that was TAKING
 * at the previous scan: for any other it is never read. */
bool moved[NPEER + 1];
#define MARK_MOVED if :: ((was_taking[0] | was_taking[1]) >> me) & 1 -> moved[me] = 1 \
    :: else -> skip fi

/* ghost state, for the properties */
byte claims[ITEMS + 1];    /* winning claims per item */
bool pub[ITEMS + 1];
byte npub[NPROD + 1];      /* items each producer has published */
byte resolved;             /* items claimed, or lost with a producer that died first */

/* A peer crashes (or is cut off) before a verb: none of its later verbs runs. A producer's
 * unpublished items are then lost, which the consumers' end condition accounts for. (With
 * one consumer only producers crash: a ring whose every consumer is dead cannot flow.) */
#define CRASH_POINT if :: crashes > 0 && (me <= NPROD || NCONS > 1) -> crashes--; dead[me] = 1; unnoticed++; dirty = 1; \
    if :: me <= NPROD -> resolved = resolved + ITEMS_OF(me) - npub[me] :: else -> skip fi; \
    goto gone :: true -> skip fi

/* A round trip: BEGIN V(verb) V(verb) ... END. By default one atomic step with a crash
 * point before it: the tcp (and local) transport, whose host runs a peer's batch whole under
 * the region lock, or not at all once the peer is gone. With -DPER_VERB every verb is its
 * own step with a crash point before it: the rdma transport, where other processes act
 * between the verbs of a batch and a dying peer's NIC may have run only a prefix of it. */
#ifdef PER_VERB
#define BEGIN
#define V(body) atomic { CRASH_POINT; body };
#define END skip
#else
#define BEGIN atomic { CRASH_POINT;
#define V(body) body;
#define END skip }
#endif

/* Outstanding tickets (rings/tickets.py outstanding()): position pos, handed out, whose
 * slot has not passed it yet. */
#define SL(pos) stamp[(pos) % CAP]
#define OUT_PUSH(pos) ((pos) < tail && ((SSTATE(SL(pos)) == FREE && SPOS(SL(pos)) <= (pos)) \
    || (SSTATE(SL(pos)) != FREE && SPOS(SL(pos)) + CAP <= (pos))))
#define POP_DONE(w) (SSTATE(w) == CLAIMED_POP || SSTATE(w) == ORPHANED)
#define OUT_POP(pos) ((pos) < head && ((!POP_DONE(SL(pos)) && SPOS(SL(pos)) <= (pos)) \
    || (POP_DONE(SL(pos)) && SPOS(SL(pos)) + CAP <= (pos))))
/* Ready to be given up (tickets.py give_up_move). */
#define READY_PUSH(pos) (SL(pos) == ST(pos, 0, FREE))
#define READY_POP(pos) (SL(pos) == ST(pos, 0, PUBLISHED) || SL(pos) == ST(pos, 0, TOMBSTONE))

/* What a ticket holder makes of its slot's stamp (peer_tickets.py _push_view / _pop_view). */
#define PUSH_WAIT(w, p) (SPOS(w) < (p))
#define POP_READY(w, q) ((w) == ST(q, 0, PUBLISHED) || (w) == ST(q, 0, ORPHANED))
#define POP_WAIT(w, q) (SPOS(w) < (q) || (w) == ST(q, 0, FREE) || \
    (SPOS(w) == (q) && SSTATE(w) == CLAIMED_PUSH))
#define POP_SKIP(w, q) ((w) == ST(q, 0, TOMBSTONE))

/* A won pop claim on pos: the ghost counts the item (core.py RingCore._claim). */
#define TAKE(s, pos) item = pay_item[s]; assert(item > 0 && pay_pos[s] == (pos)); \
    claims[item]++; assert(claims[item] == 1); resolved++
/* The READ of the claimed slot: still the item of that position (rings/payload.py unframe
 * checks the position; a stray write would show here). */
#define CHECK_READ(s, pos) assert(pay_item[s] == item && pay_pos[s] == (pos))

#define PMINE ST(p, me, CLAIMED_PUSH)
#define PUBLISH pub[item] = 1; npub[me]++

proctype producer(byte me) {
    byte k, item, p, s;
    short w, old;
    bool have, declared;
    do
    :: k == ITEMS_OF(me) -> break
    :: else ->
        item = FIRST_ITEM_OF(me) + k;
push:   /* Ring.try_push_body (and Ring.push: polling again after False) */
        if
        :: !have ->
            /* Ring._take(PUSH): WRITE seat TAKING(seq); FAA tail; READ header + stamps */
            BEGIN
            V(seat[2 * me + PUSH] = SEAT(TAKING, 0); MARK_MOVED; dirty = 1)
            V(p = tail; tail++; assert(tail < NPOS); dirty = 1)
            V(w = stamp[p % CAP])
            END;
            have = true; declared = false; s = p % CAP;
            if
            :: w == ST(p, 0, FREE) ->
                /* FREE(p) seen for our own ticket while TAKING: claim, payload, publish,
                 * then declare HOLDS(p) (try_push_body round trip 2). Nothing but our
                 * claim may change FREE(p) now: the claim must win. */
                BEGIN
                V(assert(stamp[s] == ST(p, 0, FREE)); stamp[s] = PMINE; dirty = 1)
                V(pay_item[s] = item; pay_pos[s] = p)
                V(assert(stamp[s] == PMINE); stamp[s] = ST(p, 0, PUBLISHED); PUBLISH; dirty = 1)
                V(seat[2 * me + PUSH] = SEAT(HOLDS, p); MARK_MOVED; dirty = 1)
                END;
                have = false; k++; goto pushed
            :: w != ST(p, 0, FREE) && !PUSH_WAIT(w, p) -> have = false; goto push  /* void */
            :: else -> skip
            fi
        :: else -> skip
        fi;
        /* an outstanding ticket: declare it, then claim it by CAS before any write */
        BEGIN
        if
        :: !declared -> V(seat[2 * me + PUSH] = SEAT(HOLDS, p); MARK_MOVED; dirty = 1)
        :: else -> skip
        fi;
        V(old = stamp[s]; if :: old == ST(p, 0, FREE) -> stamp[s] = PMINE; dirty = 1
                             :: else -> skip fi)
        END;
        declared = true;
        if
        :: old == ST(p, 0, FREE) ->
            BEGIN
            V(pay_item[s] = item; pay_pos[s] = p)
            V(assert(stamp[s] == PMINE); stamp[s] = ST(p, 0, PUBLISHED); PUBLISH; dirty = 1)
            END;
            have = false; k++
        :: PUSH_WAIT(old, p) ->
            stamp[s] != old;  /* full: poll again once the slot has moved */
            goto push
        :: else -> have = false; goto push  /* given up (TOMBSTONE) or past: new ticket */
        fi;
pushed: /* dead locals cleared: stale values would only make equal states differ */
        w = 0; old = 0; p = 0; s = 0; item = 0
    od;
gone: skip
}

#define QMINE ST(q, me, CLAIMED_POP)
#define XMINE ST(x, me, CLAIMED_POP)

/* Ring._take_orphan: claim the hinted ORPHANED item x, declaring our own ticket first;
 * the batch also frees it and clears the hint it tried. */
#ifdef BROKEN_POP
#define ORPHAN_CLAIM V(old = stamp[x % CAP]) END; BEGIN \
    V(if :: old == ST(x, 0, ORPHANED) -> stamp[x % CAP] = XMINE; TAKE(x % CAP, x); dirty = 1 \
         :: else -> skip fi)
#else
#define ORPHAN_CLAIM V(old = stamp[x % CAP]; \
    if :: old == ST(x, 0, ORPHANED) -> stamp[x % CAP] = XMINE; TAKE(x % CAP, x); dirty = 1 \
       :: else -> skip fi)
#endif
inline take_orphan() {
    if
    :: h > 0 && h - 1 != q ->
        x = h - 1;
        BEGIN
        if
        :: !declared -> V(seat[2 * me + POP] = SEAT(HOLDS, q); MARK_MOVED; dirty = 1)
        :: else -> skip
        fi;
        ORPHAN_CLAIM
        if
        :: old == ST(x, 0, ORPHANED) ->
            V(CHECK_READ(x % CAP, x))
            V(assert(stamp[x % CAP] == XMINE); stamp[x % CAP] = ST(x + CAP, 0, FREE); dirty = 1)
        :: else -> skip
        fi;
        V(if :: hint == x + 1 -> hint = 0; dirty = 1 :: else -> skip fi)
        END;
        declared = true;
        if
        :: old == ST(x, 0, ORPHANED) -> goto popped
        :: else -> skip
        fi
    :: else -> skip
    fi
}

proctype consumer(byte me) {
    byte q, s, x, h, item;
    short w, old, expect;
    bool have, declared, skip_pending;
    do
    :: resolved == ITEMS -> break
    :: else ->
pop:    /* Ring.try_pop (and Ring.pop: polling again after None) */
        if
        :: !have ->
            /* Ring._take(POP), with a pending tombstone skip posted first (Ring._skip) */
            BEGIN
            if
            :: skip_pending ->
                V(if :: stamp[s] == ST(q, 0, TOMBSTONE) -> stamp[s] = ST(q + CAP, 0, FREE);
                         dirty = 1 :: else -> skip fi)
            :: else -> skip
            fi;
            V(seat[2 * me + POP] = SEAT(TAKING, 0); MARK_MOVED; dirty = 1)
            V(q = head; head++; assert(head < NPOS); dirty = 1)
            V(w = stamp[q % CAP]; h = hint)
            END;
            skip_pending = false; have = true; declared = false; s = q % CAP;
            if
            :: POP_READY(w, q) ->
                /* Ring._claim(optimistic): CAS claim, READ, CAS free, WRITE HOLDS(q) */
                BEGIN
                V(assert(stamp[s] == w); stamp[s] = QMINE; TAKE(s, q); dirty = 1)
                V(CHECK_READ(s, q))
                V(assert(stamp[s] == QMINE); stamp[s] = ST(q + CAP, 0, FREE); dirty = 1)
                V(seat[2 * me + POP] = SEAT(HOLDS, q); MARK_MOVED; dirty = 1)
                END;
                have = false; goto popped
            :: POP_SKIP(w, q) -> skip_pending = true; have = false; goto pop
            :: !POP_READY(w, q) && !POP_SKIP(w, q) && !POP_WAIT(w, q) -> have = false; goto pop
            :: else -> take_orphan()  /* nothing at q yet: the hint read with the ticket */
            fi
        :: else -> skip
        fi;
        /* an outstanding ticket: declare it; claim if published (Ring._claim); the batch
         * reads the counters and the orphan hint too */
        expect = ST(q, 0, PUBLISHED);
own:    BEGIN
        if
        :: !declared -> V(seat[2 * me + POP] = SEAT(HOLDS, q); MARK_MOVED; dirty = 1)
        :: else -> skip
        fi;
        V(old = stamp[s]; if :: old == expect -> stamp[s] = QMINE; TAKE(s, q); dirty = 1
                             :: else -> skip fi)
        if
        :: old == expect ->
            V(CHECK_READ(s, q))
            V(assert(stamp[s] == QMINE); stamp[s] = ST(q + CAP, 0, FREE); dirty = 1)
        :: else -> skip
        fi;
        V(h = hint)
        END;
        declared = true;
        if
        :: old == expect -> have = false; goto popped
        :: old != expect && POP_READY(old, q) -> expect = old; goto own  /* ORPHANED(q) */
        :: old != expect && POP_SKIP(old, q) -> skip_pending = true; have = false; goto pop
        :: old != expect && POP_WAIT(old, q) ->
            take_orphan();
            /* nothing for us now: poll again once something moved */
            (stamp[s] != old || hint != h || resolved == ITEMS)
        :: else -> have = false; goto pop  /* taken or past: a new ticket */
        fi;
popped: /* dead locals cleared: stale values would only make equal states differ */
        w = 0; old = 0; expect = 0; h = 0; x = 0; item = 0;
        if :: !have -> q = 0; s = 0 :: else -> skip fi
    od;
gone: skip
}

/* Host state across scans (rings/tickets.py TicketWatch). */
bool given_up[2 * NPOS];   /* (side, position) whose holder is gone: give up when ready */
bool undecl[2 * NPOS];     /* outstanding and undeclared at the previous scan */
byte now_taking;
byte fresh_taking;
bool any_undecl;
bit rescan;                /* the next scan gives something up even if nothing moves (the
                            * Python host scans periodically; the model's only when this or
                            * dirty says it would do something) */
byte pend[2 * NPOS];       /* give-up CASes computed by the last scan, not applied yet:
                            * 1 + the state the scan saw (the CAS expects it) */
byte npend;
byte orphan_min;           /* 1 + the lowest ORPHANED position the scan saw or made */
byte idle_left = MAX_IDLE;
bool idle_cand;            /* the last scan saw a live peer's ready declared ticket */

#define GIVE_UP(side, pos) pend[(side) * NPOS + (pos)] = SSTATE(SL(pos)) + 1; npend++
/* tickets.py give_up_move: the stamp that replaces a given-up ticket's */
#define GIVEN_UP(side, pos, st) ((side) == PUSH -> ST(pos, 0, TOMBSTONE) : \
    ((st) == PUBLISHED -> ST(pos, 0, ORPHANED) : ST((pos) + CAP, 0, FREE)))

#define IDLE_READY(who, side, pos) (!revoked[who] && SKIND(seat[2 * (who) + (side)]) == HOLDS \
    && SVAL(seat[2 * (who) + (side)]) == (pos) && !given_up[(side) * NPOS + (pos)] \
    && !pend[(side) * NPOS + (pos)])

#define CLEAR_HOST_LOCALS who = 0; side = 0; pos = 0; g = 0; i = 0; declared = 0; ready = 0; \
    now_taking = 0; any_undecl = 0

active proctype host() {
    byte who, side, pos, g, i;
    bool declared, ready;
end_idle:
    do
    :: /* RingHost.revoke + repair + _release_seats, when a dead peer's connection drops */
       atomic {
        unnoticed > 0 ->
        unnoticed--;
        who = 1;
        do
        :: dead[who] && !revoked[who] -> break
        :: else -> who++
        od;
        revoked[who] = 1;
        for (i : 0 .. CAP - 1) {  /* repair(): its claims */
            if
            :: SHOLD(stamp[i]) == who && SSTATE(stamp[i]) == CLAIMED_PUSH ->
                stamp[i] = ST(SPOS(stamp[i]), 0, TOMBSTONE)
            :: SHOLD(stamp[i]) == who && SSTATE(stamp[i]) == CLAIMED_POP ->
                stamp[i] = ST(SPOS(stamp[i]) + CAP, 0, FREE)
            :: else -> skip
            fi
        }
        for (side : PUSH .. POP) {  /* _release_seats(): its declared tickets */
            if
            :: (SKIND(seat[2 * who + side]) == HOLDS && side == PUSH
                && OUT_PUSH(SVAL(seat[2 * who + side]))) ->
                given_up[side * NPOS + SVAL(seat[2 * who + side])] = 1
            :: (SKIND(seat[2 * who + side]) == HOLDS && side == POP
                && OUT_POP(SVAL(seat[2 * who + side]))) ->
                given_up[side * NPOS + SVAL(seat[2 * who + side])] = 1
            :: else -> skip
            fi;
            seat[2 * who + side] = 0
        }
        dirty = 1;
        CLEAR_HOST_LOCALS
       }
    :: /* RingHost.repair_tickets -> TicketWatch.step: one scan of the region */
       d_step {
        (dirty || rescan) && npend == 0 ->
        dirty = 0;
        rescan = 0;
        orphan_min = 0;
        for (i : 0 .. CAP - 1) {
            if
            :: SSTATE(stamp[i]) == ORPHANED && (orphan_min == 0 || SPOS(stamp[i]) + 1 < orphan_min) ->
                orphan_min = SPOS(stamp[i]) + 1
            :: else -> skip
            fi
        }
        for (side : PUSH .. POP) {
            now_taking = 0;  /* live peers TAKING now, with the same seq as at the last scan */
            for (who : 1 .. NPEER) {
                if
                :: !revoked[who] && SKIND(seat[2 * who + side]) == TAKING && !moved[who] ->
                    now_taking = now_taking | (1 << who)
                :: !revoked[who] && SKIND(seat[2 * who + side]) == TAKING && moved[who] ->
                    fresh_taking = fresh_taking | (1 << who)
                :: else -> skip
                fi
            }
            any_undecl = false;
            for (pos : 0 .. NPOS - 1) {
                g = side * NPOS + pos;
                if
                :: (side == PUSH && OUT_PUSH(pos)) || (side == POP && OUT_POP(pos)) ->
                    ready = (side == PUSH && READY_PUSH(pos)) || (side == POP && READY_POP(pos));
                    declared = false;
                    for (who : 1 .. NPEER) {
                        if
                        :: !revoked[who] && seat[2 * who + side] == SEAT(HOLDS, pos) -> declared = true
                        :: else -> skip
                        fi
                    }
                    if
                    :: !given_up[g] && !declared ->
                        /* undeclared at the previous scan too, and everyone TAKING then has
                         * moved on (written its seat since, or gone): a dead peer's */
#ifdef BROKEN_WATCH
                        if
                        :: true -> given_up[g] = 1; undecl[g] = 0
#else
                        if
                        :: undecl[g] && (was_taking[side] & now_taking) == 0 ->
                            given_up[g] = 1; undecl[g] = 0
#endif
                        :: else -> undecl[g] = 1; any_undecl = true
                        fi
                    :: else -> undecl[g] = 0
                    fi;
                    if
                    :: given_up[g] && ready -> GIVE_UP(side, pos)
                    :: !given_up[g] && declared && ready -> idle_cand = 1
                    :: else -> skip
                    fi
                :: else -> given_up[g] = 0; undecl[g] = 0
                fi
            }
            if
            :: any_undecl -> was_taking[side] = now_taking | fresh_taking;
                if :: was_taking[side] == 0 -> rescan = 1 :: else -> skip fi
            :: else -> was_taking[side] = 0
            fi;
            fresh_taking = 0
        }
        if  /* no give-up to apply: the orphan hint is written now */
        :: npend == 0 && hint != orphan_min -> hint = orphan_min
        :: else -> skip
        fi;
        for (who : 1 .. NPEER) {
            moved[who] = 0
        }
        CLEAR_HOST_LOCALS
       }
    :: /* the give-up CASes of a scan, one verb each (RingHost.repair_tickets) */
       atomic {
        npend > 0 ->
        g = 0;
        do
        :: pend[g] -> break
        :: else -> g++
        od;
        pos = g % NPOS;
        side = g / NPOS;
        if
        :: SL(pos) == ST(pos, 0, pend[g] - 1) ->
            SL(pos) = GIVEN_UP(side, pos, pend[g] - 1);
            if
            :: (side == POP && pend[g] - 1 == PUBLISHED
                && (orphan_min == 0 || pos + 1 < orphan_min)) ->
                orphan_min = pos + 1
            :: else -> skip
            fi;
            dirty = 1
        :: else -> skip
        fi;
        pend[g] = 0;
        npend--;
        if  /* the last one: write the orphan hint */
        :: npend == 0 && hint != orphan_min -> hint = orphan_min; dirty = 1
        :: else -> skip
        fi;
        CLEAR_HOST_LOCALS
       }
    :: /* the claim timeout: a live peer left a ready declared ticket unused (TicketWatch.step) */
       atomic {
        idle_left > 0 && idle_cand && npend == 0 ->
        idle_cand = 0;
        who = 1;
        do
        :: who > NPEER -> break
        :: (who <= NPEER && SKIND(seat[2 * who + PUSH]) == HOLDS
            && IDLE_READY(who, PUSH, SVAL(seat[2 * who + PUSH]))
            && OUT_PUSH(SVAL(seat[2 * who + PUSH])) && READY_PUSH(SVAL(seat[2 * who + PUSH]))) ->
            pos = SVAL(seat[2 * who + PUSH]);
            given_up[PUSH * NPOS + pos] = 1; GIVE_UP(PUSH, pos); idle_left--; break
        :: (who <= NPEER && SKIND(seat[2 * who + POP]) == HOLDS
            && IDLE_READY(who, POP, SVAL(seat[2 * who + POP]))
            && OUT_POP(SVAL(seat[2 * who + POP])) && READY_POP(SVAL(seat[2 * who + POP]))) ->
            pos = SVAL(seat[2 * who + POP]);
            given_up[POP * NPOS + pos] = 1; GIVE_UP(POP, pos); idle_left--; break
        :: else -> who++
        od;
        CLEAR_HOST_LOCALS
       }
    od
}

init {
    byte i;
    atomic {
        for (i : 0 .. CAP - 1) {
            stamp[i] = ST(i, 0, FREE)
        }
        for (i : 1 .. NPROD) {
            run producer(i)
        }
        for (i : NPROD + 1 .. NPEER) {
            run consumer(i)
        }
    }
}
