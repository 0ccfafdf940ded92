"""Gemma3ForConditionalGeneration: image tokens attend each other bidirectionally.

transformers builds gemma3's masks as causal OR "same image block" (global layers) and
window AND (causal OR same block) (local layers), from ``token_type_ids``; hf_flash turns them
into one key range per query row (integration.masks.row_key_bounds) and runs the kernels'
``key_bounds``. A tiny random model built from its config (offline): its image blocks (9
tokens) are longer than its window (8), and two images share a row. Checked against eager with
the model-level error rule (float64 eager is the truth), padded batches too, and greedy generate.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_flash.reference import FWD_FACTOR

from tiny_models import assert_model_close

IMAGE, BOI, EOI, VOCAB = 120, 121, 122, 128
TOKENS_PER_IMAGE = 9  # 3 x 3 patches of 4 pixels: 12 x 12 images


def _config():
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=12, patch_size=4, num_channels=3,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE, boi_token_index=BOI,
        eoi_token_index=EOI, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def saved(root):
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(_config())
    with torch.no_grad():  # sharper attention than std-0.02 init, so masking errors show
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20.0)
    path = root / "gemma3"
    model.save_pretrained(path)
    return path


def _load(path, attn, dtype, device):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, attn_implementation=attn, dtype=dtype
    )
    return model.to(device).eval()


def _row(*pieces):
    """Token ids from pieces: an int n is n random text tokens, "img" one image's tokens."""
    g = torch.Generator().manual_seed(sum(p if isinstance(p, int) else 7 for p in pieces))
    ids = []
    for p in pieces:
        ids += [IMAGE] * TOKENS_PER_IMAGE if p == "img" else torch.randint(3, 100, (p,), generator=g).tolist()
    return ids


def _batch(device, padded: bool):
    """Two rows of 30 tokens: row 0 one image, row 1 two; when ``padded`` row 0 is left-padded
    by 4 and row 1 right-padded by 3."""
    rows = [_row(10, "img", 11), _row(3, "img", 4, "img", 5)]
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :4] = ids[1, -3:] = 0
        mask[0, :4] = mask[1, -3:] = 0
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(3, 3, 12, 12, generator=g)  # images in row order
    return ids.to(device), mask.to(device), pixels.to(device)


def _logits(model, ids, mask, pixels, dtype, types=True):
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask, pixel_values=pixels.to(dtype),
            token_type_ids=(ids == IMAGE).long() if types else None, use_cache=False,
        )  # fmt: skip
    return out.logits


def _exact_rows(model, ids, mask, pixels):
    """float64 eager, each row alone without its padding (at its original positions)."""
    out, first = [], 0
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        row = ids[r, keep][None]
        n_images = int((row == IMAGE).sum()) // TOKENS_PER_IMAGE
        pos = torch.arange(ids.shape[1], device=ids.device)[keep][None]
        with torch.no_grad():
            logits = model(
                input_ids=row, attention_mask=torch.ones_like(row), position_ids=pos,
                pixel_values=pixels[first : first + n_images].double(),
                token_type_ids=(row == IMAGE).long(), use_cache=False,
            ).logits  # fmt: skip
        out.append(logits[0])
        first += n_images
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),  # the interpreter's bf16 is fp32
])  # fmt: skip
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_image_tokens_match_eager(saved, padded, dtype, device):
    ids, mask, pixels = _batch(device, padded)
    ours = _logits(_load(saved, "hf_flash", dtype, device), ids, mask, pixels, dtype)
    lowp = _logits(_load(saved, "eager", dtype, device), ids, mask, pixels, dtype)
    exact = _exact_rows(_load(saved, "eager", torch.float64, device), ids, mask, pixels)
    valid = mask.bool()
    assert_model_close("logits", ours[valid], exact, lowp[valid], FWD_FACTOR, dtype)
    if dtype != torch.float32:
        return
    # the check sees the image blocks: attending them causally (flash_attention_2's result) fails it
    with pytest.raises(AssertionError, match="logits"):
        causal = _logits(_load(saved, "hf_flash", dtype, device), ids, mask, pixels, dtype, types=False)
        assert_model_close("logits", causal[valid], exact, lowp[valid], FWD_FACTOR, dtype)


def test_masks_are_per_row_key_ranges(saved, device):
    """What the attention layers receive: gemma3's two mask functions as key ranges, the
    window AND-ed on the local layers; image rows reach to their block's end."""
    model = _load(saved, "hf_flash", torch.float32, device)
    ids, mask, pixels = _batch(device, padded=True)
    seen = []

    def spy(module, args, kwargs):
        seen.append(kwargs["attention_mask"])

    hooks = [layer.self_attn.register_forward_pre_hook(spy, with_kwargs=True)
             for layer in model.model.language_model.layers]  # fmt: skip
    try:
        _logits(model, ids, mask, pixels, torch.float32)
    finally:
        for h in hooks:
            h.remove()
    local, full = (m.cpu() for m in seen)
    assert local.dtype == full.dtype == torch.int32 and local.shape == (2, 30, 2)
    # row 1: text 0..2, image 3..11, text 12..15, image 16..24, text 25..29
    assert full[1, 2].tolist() == [0, 3] and full[1, 3].tolist() == [0, 12]
    assert full[1, 11].tolist() == [0, 12] and full[1, 12].tolist() == [0, 13]
    assert local[1, 16].tolist() == [9, 25] and local[1, 24].tolist() == [17, 25]
    # row 0, left-padded by 4: padding rows see nothing, real rows start at key 4
    assert full[0, 2, 0] >= full[0, 2, 1] and full[0, 4].tolist() == [4, 5]
    assert full[0, 14].tolist() == [4, 19]  # image 10..18


def test_greedy_generate_equals_eager(saved, device):
    ids, mask, pixels = _batch(device, padded=True)
    tokens = {}
    for attn in ("hf_flash", "eager"):
        model = _load(saved, attn, torch.float32, device)
        with torch.no_grad():
            tokens[attn] = model.generate(
                input_ids=ids, attention_mask=mask, pixel_values=pixels,
                token_type_ids=(ids == IMAGE).long(), max_new_tokens=4, do_sample=False,
            )  # fmt: skip
    assert torch.equal(tokens["hf_flash"], tokens["eager"])


def test_unsupported_mask_functions_raise_before_any_kernel(device):
    """A mask function hf_flash cannot turn into one key range per row is named in the error,
    and so is padding inside a row next to image blocks."""
    from transformers import masking_utils as mu

    from hf_flash.integration.masks import hf_flash_mask

    blocks = torch.tensor([[-1, 0, 0, -1, 1, 1]], device=device)
    causal_blocks = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks))
    with pytest.raises(ValueError, match="chunked_overlay"):
        hf_flash_mask(1, 6, 6, mask_function=mu.and_masks(
            causal_blocks, mu.chunked_overlay(2, torch.zeros(1, dtype=torch.long))), device=device)
    with pytest.raises(ValueError, match="<lambda>"):
        hf_flash_mask(1, 6, 6, mask_function=mu.or_masks(mu.causal_mask_function, lambda *a: True),
                      use_vmap=True, device=device)  # fmt: skip
    holes = torch.tensor([[1, 1, 0, 1, 1, 1]], device=device)
    with pytest.raises(ValueError, match="padding inside a sequence"):
        hf_flash_mask(1, 6, 6, mask_function=causal_blocks, attention_mask=holes, device=device)
    split = torch.tensor([[0, 0, -1, 0, 1, 1]], device=device)
    with pytest.raises(ValueError, match="two separate runs"):
        hf_flash_mask(1, 6, 6, mask_function=mu.or_masks(
            mu.causal_mask_function, mu.blockwise_overlay(split)), device=device)


def test_key_ranges_equal_transformers_own_mask(device):
    """row_key_bounds against transformers' sdpa mask of the same mask functions (5.17's and the
    newer release's pieces), for a window, offsets (a cache) and padding."""
    from transformers import masking_utils as mu

    from hf_flash.integration.masks import row_key_bounds

    g = torch.Generator().manual_seed(0)
    batch, q_len, kv_offset, q_offset = 3, 20, 2, 6
    kv_len = q_offset + q_len - kv_offset
    types = (torch.rand(batch, q_offset + q_len, generator=g) < 0.5).long()
    ids = torch.where(types == 1, (types.diff(dim=1, prepend=torch.zeros(batch, 1, dtype=torch.long)) == 1).cumsum(1), -1)
    padding = torch.ones(batch, q_offset + q_len, dtype=torch.bool)
    padding[1, :3] = False
    padding[2, -2:] = False
    for fn in (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)),
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)), mu.sliding_window_overlay(5)),
        mu.or_masks(mu.sliding_window_causal_mask_function(5), mu.blockwise_overlay(ids)),
    ):
        want = mu.sdpa_mask(
            batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=fn, attention_mask=padding, allow_is_causal_skip=False, use_vmap=True,
        )[:, 0]  # fmt: skip
        bounds = row_key_bounds(fn, batch, q_len, kv_len, q_offset, kv_offset, padding)
        j = torch.arange(kv_len)
        got = (j >= bounds[..., :1]) & (j < bounds[..., 1:])
        assert torch.equal(got, want), fn


def test_loads_where_transformers_declares_no_flash_support():
    """transformers >= 5.24 sets ``_supports_flash_attn = False`` on gemma3's multimodal classes
    ("Flash Attention drops the bidirectional mask over image tokens"); hf_flash keeps that mask,
    so it loads them (registration.IMAGE_BLOCK_MODEL_TYPES), and still refuses any other class
    that declares no flash support."""
    from hf_flash.integration.registration import check_model_supported

    class NoFlashGemma3(transformers.Gemma3ForConditionalGeneration):
        _supports_flash_attn = False

    class NoFlashLlama(transformers.LlamaForCausalLM):
        _supports_flash_attn = False

    check_model_supported(NoFlashGemma3)
    with pytest.raises(ValueError, match="_supports_flash_attn is False"):
        check_model_supported(NoFlashLlama)
