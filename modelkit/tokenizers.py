"""The tokenizers of the tiny models, built locally from a few sentences (nothing is
downloaded): a byte-level BPE ``Qwen2Tokenizer`` and a unigram ``T5Tokenizer``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any, cast

# ---------------------------------------------------------------------------------------------
# Text used to build the tokenizers. Qwen's pipelines wrap every prompt in a chat template with
# a fixed system prompt and then drop a fixed number of leading hidden states (34 for T2I, 64
# for Edit), which must be exactly the system part. The real Qwen vocabulary has one token per
# word of those system prompts, so a byte-level BPE that also merges each of their words whole
# puts the cut at the same place. The templates are read from diffusers' pipeline classes.
# ---------------------------------------------------------------------------------------------
CORPUS = (
    "A cat and a dog baking a cake together in a kitchen.",
    "A red fox running through fresh snow at sunrise, cinematic lighting.",
    "An astronaut riding a horse on the moon, highly detailed.",
    "A small wooden boat floating on a calm lake surrounded by mountains.",
    "Close-up of a blue flower with water drops, macro photo.",
    "A busy city street at night with neon signs and rain.",
    "Make the sky purple and add a rainbow over the house.",
    "Turn the photo into a watercolor painting with soft colors.",
    "A girl reading a book under a tree in the park.",
    "Waves crashing on the rocks of a lighthouse during a storm.",
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality.",
    "A cute robot holding a sign that says hello world.",
)

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)



# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------
def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE alphabet: printable bytes stand for themselves, the others are shifted
    past 255 so that every byte has a visible, non-whitespace character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _bpe_split(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges to one pre-token: repeatedly merge the best-ranked adjacent pair."""
    while len(symbols) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(symbols) - 1):
            rank = ranks.get((symbols[i], symbols[i + 1]))
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]
    return symbols


def _qwen_pretokens(texts: Iterable[str]) -> list[str]:
    """Qwen2's pre-tokenization (special tokens split off first, as the tokenizer does)."""
    import regex
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pattern = regex.compile(PRETOKENIZE_REGEX)
    out: list[str] = []
    for text in texts:
        for piece in regex.split(r"<\|[a-z_]+\|>", text):
            out.extend(pattern.findall(piece))
    return out


def _qwen_templates() -> list[tuple[str, int]]:
    """(prompt template, hidden states dropped) of diffusers' Qwen-Image and Qwen-Image-Edit
    pipelines, as the encoder stage reads them (so they match the installed diffusers)."""
    from workers.models.families.qwen_text import prompt_template

    # EditPlus (2509 / 2511) shares the Edit system prompt and cut: no template of its own.
    classes = ("QwenImagePipeline", "QwenImageEditPipeline")
    return [(t.template, t.drop) for t in map(prompt_template, classes)]


def build_qwen_tokenizer() -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` that merges every word of the pipelines' system
    prompts (and of a small corpus) into one token, with Qwen's special tokens."""
    from transformers import Qwen2Tokenizer

    byte_map = _byte_to_unicode()
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[byte_map[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}

    # Template words first, then the corpus by descending frequency (ties alphabetical), so the
    # merge table does not depend on dict or set ordering.
    templates = _qwen_templates()
    template_words = _qwen_pretokens(t.replace("{}", "") for t, _ in templates)
    corpus_counts = Counter(_qwen_pretokens(CORPUS))
    corpus_words = sorted(corpus_counts, key=lambda w: (-corpus_counts[w], w))
    seen: set[str] = set()
    for word in [*template_words, *corpus_words]:
        if word in seen:
            continue
        seen.add(word)
        encoded = "".join(byte_map[b] for b in word.encode("utf-8"))
        pieces = _bpe_split(list(encoded), ranks)
        # Merges appended now rank below every earlier merge, so they can never interrupt the
        # merge sequence of a word that is already whole: earlier words stay one token.
        current = pieces[0]
        for piece in pieces[1:]:
            pair = (current, piece)
            ranks[pair] = len(merges)
            merges.append(pair)
            current = current + piece
            if current not in vocab:
                vocab[current] = len(vocab)

    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=cast(Any, merges),  # pairs; the annotation only names the "a b" string form
        unk_token=cast(Any, None),  # byte-level: every input has a token, as in real Qwen
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=131072,
    )
    for template, drop in templates:
        _check_qwen_cut(tokenizer, template, drop)
    return tokenizer


def _check_qwen_cut(tokenizer: Any, template: str, drop: int) -> None:
    """The pipeline drops ``drop`` leading hidden states; they must be exactly the system turn
    plus the opening of the user turn with this tokenizer, else the build is wrong."""
    user_turn = "<|im_start|>user\n"
    prefix = template[: template.index("{}")]
    system = prefix[: prefix.index(user_turn) + len(user_turn)]
    system_ids = tokenizer(system)["input_ids"]
    prefix_ids = tokenizer(prefix + "A cat")["input_ids"]
    if len(system_ids) != drop or prefix_ids[:drop] != system_ids:
        raise RuntimeError(
            f"the Qwen template's system part tokenizes to {len(system_ids)} tokens, but the "
            f"pipeline drops {drop}"
        )


def build_t5_tokenizer() -> Any:
    """A unigram ``T5Tokenizer`` (SentencePiece-style ``▁`` word pieces): one piece per corpus
    word, scored by log frequency, plus every printable ASCII character so any English prompt
    tokenizes without ``<unk>``."""
    import string

    from transformers import T5Tokenizer

    words = Counter(w for line in CORPUS for w in line.split())
    total = sum(words.values())
    pieces: dict[str, float] = {}
    for word, count in words.items():
        pieces["\u2581" + word] = math.log(count / total)
    pieces["\u2581"] = -8.0
    for ch in string.ascii_letters + string.digits + string.punctuation:
        # Far below any word piece: a word found in the vocabulary always wins over spelling.
        pieces.setdefault(ch, -12.0)
        pieces.setdefault("\u2581" + ch, -11.0)
    ordered = sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *ordered]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


