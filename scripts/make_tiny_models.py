#!/usr/bin/env python3
"""Build tiny random-weight models of the real diffusers architectures, offline.

    python scripts/make_tiny_models.py --out DIR [--seed N] [--tasks wan_t2v,qwen_t2i] [--force]

For each task this writes ``DIR/<task>/``, a diffusers-format folder (``model_index.json`` plus
one sub-folder per component, written with ``save_pretrained``) that the stock diffusers
pipelines and our stage adapters load with ``from_pretrained``:

* ``wan_t2v``  - Wan2.1 text-to-video: UMT5 text encoder + T5 tokenizer, WanTransformer3DModel,
  AutoencoderKLWan, UniPC scheduler with Wan's flow-matching settings.
* ``wan_i2v``  - Wan2.1 image-to-video: the above + CLIP vision encoder and image processor; the
  DiT has ``image_dim`` / ``added_kv_proj_dim`` set as real I2V checkpoints do.
* ``qwen_t2i`` - Qwen-Image: Qwen2.5-VL text encoder + byte-level BPE Qwen2 tokenizer,
  QwenImageTransformer2DModel, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler.
* ``qwen_i2i`` - Qwen-Image-Edit: the above + a ``processor`` folder (image processor +
  tokenizer) for the vision-language prompt.
* ``synthetic`` - no model: ``synthetic.json`` with the synthetic pipeline's default stage
  times and tensor shapes (``workers/models/synthetic.py``); needs no torch.

Nothing is downloaded: the tokenizers are built here from a few sentences, the weights are
random (seeded, so a build is reproducible with the same torch version). The sizes are chosen
so that a whole request runs in about a second on one CPU core, while every code path of the
real models (cross attention, I2V image attention, multimodal RoPE, VAE temporal causality)
is still exercised.

A build is idempotent: ``DIR/<task>/diffring_tiny.json`` records the build parameters, and a
folder whose marker matches is left alone. Folders are built in a temporary sibling and moved
into place, so a concurrent or interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

# Bump whenever a config, a tokenizer rule or an initialisation below changes, so that old
# folders are rebuilt instead of silently reused.
RECIPE_VERSION = 2
MARKER_NAME = "diffring_tiny.json"
TASKS = ("wan_t2v", "wan_i2v", "qwen_t2i", "qwen_i2i", "synthetic")

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
# Model sizes. Real checkpoints are noted next to each value that differs structurally.
# ---------------------------------------------------------------------------------------------
WAN_TEXT_DIM = 32  # UMT5-XXL: 4096
WAN_CLIP_DIM = 32  # CLIP ViT-H/14: 1280
WAN_HEADS, WAN_HEAD_DIM = 2, 12  # Wan2.1-1.3B: 12 x 128; 14B: 40 x 128
QWEN_TEXT_DIM = 32  # Qwen2.5-VL-7B: 3584
QWEN_HEADS, QWEN_HEAD_DIM = 2, 16  # Qwen-Image: 24 x 128
# The condition image of Qwen-Image-Edit is resized to ~1 megapixel before the vision-language
# model sees it; the processor then rescales it to between min and max pixels (real: 3136 and
# 12845056). A small max keeps the tiny encoder fast: 56x56 pixels -> 4 image tokens.
QWEN_VL_MAX_PIXELS = 56 * 56
QWEN_VL_MIN_PIXELS = 28 * 28


def _log(msg: str) -> None:
    print(f"[make_tiny_models] {msg}", file=sys.stderr, flush=True)


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
    from workers.models.qwen_text import prompt_template

    return [(t.template, t.drop) for t in (prompt_template(False), prompt_template(True))]


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


# ---------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------
def _seeded(seed: int, salt: str) -> None:
    """Seed torch per component, so a component's weights do not depend on build order."""
    import zlib

    import torch

    torch.manual_seed((seed * 1_000_003 + zlib.crc32(salt.encode())) % (2**63))


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _wan_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    # Wan2.1's published scheduler: UniPC in flow-matching mode; flow_shift 3.0 is the 480p
    # setting (5.0 for 720p).
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )


def _qwen_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Qwen-Image's published scheduler: resolution-dependent shift (mu from the image sequence
    # length) with a terminal shift.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def _wan_vae(seed: int) -> Any:
    from diffusers import AutoencoderKLWan

    _seeded(seed, "wan.vae")
    # Real: base_dim 96. Same depth, strides, temporal causality and latent channels.
    model: Any = AutoencoderKLWan(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    return model.eval()


def _wan_text_encoder(seed: int, vocab_size: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    _seeded(seed, "wan.text_encoder")
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=WAN_TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config).eval()


def _wan_transformer(seed: int, i2v: bool) -> Any:
    from diffusers import WanTransformer3DModel

    _seeded(seed, "wan.transformer.i2v" if i2v else "wan.transformer.t2v")
    inner = WAN_HEADS * WAN_HEAD_DIM
    model: Any = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=WAN_HEADS,
        attention_head_dim=WAN_HEAD_DIM,
        # I2V input: 16 noise channels + 4 first-frame mask channels + 16 condition channels.
        in_channels=36 if i2v else 16,
        out_channels=16,
        text_dim=WAN_TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=WAN_CLIP_DIM if i2v else None,
        # Real Wan2.1 I2V checkpoints set this to the model width (5120 for 14B).
        added_kv_proj_dim=inner if i2v else None,
        rope_max_seq_len=1024,
    )
    return model.eval()


def _clip_vision(seed: int) -> tuple[Any, Any]:
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    _seeded(seed, "wan.image_encoder")
    config = CLIPVisionConfig(
        hidden_size=WAN_CLIP_DIM,
        intermediate_size=37,
        num_hidden_layers=3,  # the pipeline reads the penultimate layer
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        hidden_act="gelu",
        projection_dim=32,
    )
    model = CLIPVisionModel(config).eval()
    # Real: 224x224 crops. The PIL backend saves the same config as the torchvision one
    # ("CLIPImageProcessor") and needs no torchvision here.
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return model, processor


def _qwen_vae(seed: int) -> Any:
    from diffusers import AutoencoderKLQwenImage

    _seeded(seed, "qwen.vae")
    # Real: base_dim 96, dim_mult [1, 2, 4, 4]. Qwen-Image-Edit VAE-encodes its condition image
    # at ~1 megapixel, so this VAE is the slowest part of the tiny models on CPU: a flat width
    # of 8 channels measured fastest (narrower convolutions fall off PyTorch's oneDNN path).
    model: Any = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    return model.eval()


def _qwen_text_encoder(seed: int, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    _seeded(seed, "qwen.text_encoder")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    head_dim = QWEN_TEXT_DIM // 2
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": _round_up(len(tokenizer), 64),
            "hidden_size": QWEN_TEXT_DIM,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # Multimodal RoPE: temporal/height/width sections of head_dim / 2 (real: 16/24/24).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [2, 3, 3],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "out_hidden_size": QWEN_TEXT_DIM,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_config: Any = config.text_config
    assert head_dim // 2 == sum(text_config.rope_parameters["mrope_section"])
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen_transformer(seed: int) -> Any:
    from diffusers import QwenImageTransformer2DModel

    _seeded(seed, "qwen.transformer")
    model: Any = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels x 2x2 packing
        out_channels=16,
        num_layers=2,
        attention_head_dim=QWEN_HEAD_DIM,
        num_attention_heads=QWEN_HEADS,
        joint_attention_dim=QWEN_TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # frame/height/width split of head_dim (real: 16/56/56)
    )
    return model.eval()


def _qwen_vl_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=QWEN_VL_MIN_PIXELS,
        max_pixels=QWEN_VL_MAX_PIXELS,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


# ---------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------
def _build_wan(dest: Path, seed: int, i2v: bool) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    tokenizer = build_t5_tokenizer()
    common: dict[str, Any] = {
        "tokenizer": tokenizer,
        "text_encoder": _wan_text_encoder(seed, _round_up(len(tokenizer), 64)),
        "vae": _wan_vae(seed),
        "scheduler": _wan_scheduler(),
        "transformer": _wan_transformer(seed, i2v),
    }
    pipe: Any
    if i2v:
        image_encoder, image_processor = _clip_vision(seed)
        pipe = WanImageToVideoPipeline(
            image_encoder=image_encoder, image_processor=image_processor, **common
        )
    else:
        pipe = WanPipeline(**common)
    pipe.save_pretrained(dest, safe_serialization=True)
    if i2v:
        # Name the image processor as the published checkpoint does. save_pretrained records
        # the PIL class used here, which would pin loaders to the PIL backend even where
        # torchvision is installed (diffusers and our stage would then resize differently).
        _patch_model_index(dest, image_processor=["transformers", "CLIPImageProcessor"])


def _build_qwen(dest: Path, seed: int, edit: bool) -> None:
    from diffusers import QwenImagePipeline

    tokenizer = build_qwen_tokenizer()
    pipe: Any = QwenImagePipeline(
        scheduler=_qwen_scheduler(),
        vae=_qwen_vae(seed),
        text_encoder=_qwen_text_encoder(seed, tokenizer),
        tokenizer=tokenizer,
        transformer=_qwen_transformer(seed),
    )
    pipe.save_pretrained(dest, safe_serialization=True)
    if not edit:
        return
    # Qwen-Image-Edit shares every component with Qwen-Image and adds a vision-language
    # processor. Saved as its parts (image processor + tokenizer) in the layout of the real
    # checkpoint: transformers 5's Qwen2VLProcessor also wants a video processor, which needs
    # torchvision, so loaders build the processor from these two parts.
    processor_dir = dest / "processor"
    _qwen_vl_image_processor().save_pretrained(processor_dir)
    tokenizer.save_pretrained(processor_dir)
    _patch_model_index(
        dest,
        _class_name="QwenImageEditPipeline",
        processor=["transformers", "Qwen2VLProcessor"],
    )


def _patch_model_index(dest: Path, **entries: Any) -> None:
    index_path = dest / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(entries)
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def _marker(task: str, seed: int) -> dict[str, Any]:
    return {"format": "diffring-tiny", "recipe_version": RECIPE_VERSION, "task": task, "seed": seed}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(folder: Path, task: str, seed: int) -> bool:
    found = _read_marker(folder)
    if found is None:
        return False
    want = _marker(task, seed)
    return all(found.get(k) == v for k, v in want.items())


def build_task(out: Path, task: str, seed: int = 0, force: bool = False) -> Path:
    """Build ``out/<task>`` unless a folder with the same build parameters is already there."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    dest = out / task
    if not force and _marker_matches(dest, task, seed):
        _log(f"{dest}: up to date, skipped")
        return dest
    if task == "synthetic":
        return _build_synthetic(dest, task, seed)

    import diffusers
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{task}.", dir=out))
    try:
        with torch.no_grad():
            if task.startswith("wan_"):
                _build_wan(tmp, seed, i2v=task == "wan_i2v")
            else:
                _build_qwen(tmp, seed, edit=task == "qwen_i2i")
        marker = {
            **_marker(task, seed),
            "built_with": {
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if dest.exists():
            if not force and _marker_matches(dest, task, seed):
                # Another process finished the same build first; keep theirs.
                shutil.rmtree(tmp)
                return dest
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"{dest}: built in {time.monotonic() - started:.1f} s")
    return dest


def _build_synthetic(dest: Path, task: str, seed: int) -> Path:
    """The synthetic pipeline's folder: its default config and the marker (no weights)."""
    from workers.models.synthetic import write_config

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{task}.", dir=dest.parent))
    try:
        write_config(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(_marker(task, seed), indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"{dest}: written")
    return dest


def build_all(out: Path, seed: int = 0, tasks: Sequence[str] = TASKS, force: bool = False) -> None:
    """Build every task in ``tasks`` under ``out``."""
    for task in tasks:
        build_task(out, task, seed, force=force)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write <task>/ into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--tasks",
        default=",".join(TASKS),
        help=f"comma-separated subset of {','.join(TASKS)} (default: all)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; expected {', '.join(TASKS)}")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_all(args.out, args.seed, tasks, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
