"""zorro's verl engine on multimodal micro-batches (issue 48) against verl's own engine, in float64.

Runs where verl >= 0.8 is importable (`.ci/verl_tests`). Tiny random Qwen2.5-VL and Qwen3-VL built
in code and saved for verl's `HFModelConfig`; both engines are built by verl's own code on CPU
(zorro_core.integrations.verl.cpu). The batch is what verl's agent loop writes: each row's
`multi_modal_inputs` (the processor's `pixel_values` and `image_grid_thw`, verl's `images_seqlens`)
and its [4, len] position ids (text positions, then the model's `get_rope_index` of the whole row,
as verl computes them), made no-padding by verl's `left_right_2_no_padding`. Groups: one image
(3 rows), the same text with another image (2 rows), two images with the first recurring from the
first group (3 rows), a text-only prompt (1 row), shuffled. verl's own engine serves it without
removing padding (its remove-padding path for Qwen2.5-VL calls flash-attn, absent on CPU); zorro's
engine with and without. Log-probs, entropy and every gradient, the vision tower's included, are
compared; a planted bug (each response's positions one off) must fail.
"""

from __future__ import annotations

import functools

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
from packaging.version import Version  # noqa: E402

if Version(verl.__version__) < Version("0.8"):
    pytest.skip(f"verl {verl.__version__} < 0.8 has the legacy workers, not the engines", allow_module_level=True)

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_TOL  # noqa: E402
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_TOL  # noqa: E402

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
IMAGE, VIDEO, START, END = 250, 251, 252, 253
TEMPERATURE = 0.7
PLANTED_MIN = 1e-3


def _image(g: torch.Generator, t: int, h: int, w: int):
    return torch.randn(t * h * w, 24, generator=g, dtype=torch.float64), torch.tensor([t, h, w])


def _placeholders(grid, token=IMAGE) -> list[int]:
    return [START] + [token] * (int(grid.prod()) // 4) + [END]


def rows_spec(seed: int = 0):
    """(prompt tokens, images, response tokens) per row, rows shuffled; and each row's group."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = _image(g, 1, 4, 4), _image(g, 1, 4, 6), _image(g, 1, 2, 4)
    t1, t2 = [5, 6, 7], [9, 10]
    prompts = [
        (t1 + _placeholders(a[1]) + [8], [a]),
        (t1 + _placeholders(b[1]) + [8], [b]),
        (t2 + _placeholders(a[1]) + _placeholders(c[1]) + [3], [a, c]),
        ([4, 5, 6, 7, 8], []),
    ]
    sizes = (3, 2, 3, 1)
    rows = []
    for u, n in enumerate(sizes):
        for _ in range(n):
            r = torch.randint(11, 240, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            rows.append((prompts[u][0], prompts[u][1], r, u))
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order]


def vlm_padded_batch(model, spec, seed: int = 0):
    """verl's rollout batch of a vision-language model (module doc), padded as DataProto gives it."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    from zorro_core.models.vision import token_types

    b = len(spec)
    p, r = max(len(s[0]) for s in spec), max(len(s[2]) for s in spec)
    prompt_ids = torch.zeros(b, p, dtype=torch.long)
    response_ids = torch.zeros(b, r, dtype=torch.long)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    position_ids = torch.zeros(b, 4, p + r, dtype=torch.long)
    mm = []
    for i, (prompt, images, response, _, *video) in enumerate(spec):
        prompt_ids[i, p - len(prompt) :] = torch.tensor(prompt)
        response_ids[i, : len(response)] = torch.tensor(response)
        mask[i, p - len(prompt) : p + len(response)] = 1
        ids = torch.tensor(prompt + response)[None]
        grid = torch.stack([im[1] for im in images]) if images else None
        # verl's agent loop: the model's get_rope_index of the whole row, after the text positions.
        vgrid = video[0][1][None] if video else None
        rope, _ = model.model.get_rope_index(
            ids,
            image_grid_thw=grid,
            video_grid_thw=vgrid,
            mm_token_type_ids=token_types(ids, model.config),
            attention_mask=torch.ones_like(ids),
        )
        real = mask[i].bool()
        position_ids[i, 0, real] = torch.arange(ids.shape[1])
        position_ids[i, 1:, real] = rope[:, 0]
        row: dict = {}
        if images:
            row.update(
                pixel_values=torch.cat([im[0] for im in images]),
                image_grid_thw=grid,
                images_seqlens=torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
            )
        if video:
            row.update(pixel_values_videos=video[0][0], video_grid_thw=vgrid)
        mm.append(row)
    g = torch.Generator().manual_seed(seed)
    response_mask = mask[:, p:].clone()
    return TensorDict(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": (-torch.rand(b, r, generator=g, dtype=torch.float64) * 6) * response_mask,
            "advantages": torch.randn(b, r, generator=g, dtype=torch.float64) * response_mask,
            "multi_modal_inputs": NonTensorStack.from_list([NonTensorData(x) for x in mm]),
        },
        batch_size=b,
    )


@functools.lru_cache(maxsize=None)
def model_dir(tmp: str, family: str) -> str:
    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.vision import build_vision_model, tiny_config

    return save_model(build_vision_model(tiny_config(family), dtype=torch.float64), tmp)


def _loss_fn():
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=3, entropy_coeff=0.01
    )
    return functools.partial(ppo_loss, config=config)


def _run(engine, padded, train: bool, **meta):
    from verl.workers.utils.padding import no_padding_2_padding

    from zorro_core.integrations.verl.cpu import engine_batch

    rp = meta.pop("use_remove_padding")
    if train:
        meta.setdefault("return_model_output", True)
    data = engine_batch(padded, temperature=TEMPERATURE, calculate_entropy=True, use_remove_padding=rp, **meta)
    grads = {}
    if train:
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            out = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
            for name, p in engine.module.named_parameters():
                if p.grad is not None:
                    g = p.grad
                    grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        engine.optimizer_zero_grad()
    else:
        with engine.eval_mode(disable_auto_offload=True):
            out = engine.infer_batch(data)
    mo = out["model_output"]
    return no_padding_2_padding(mo["log_probs"], data), no_padding_2_padding(mo["entropy"], data), grads, out


def _errors(ours, ref, mask) -> dict:
    from zorro_core.verify.reference import rel_grad_errors

    out = {
        "lp": float((ours[0] - ref[0])[mask].abs().max()),
        "ent": float((ours[1] - ref[1])[mask].abs().max()),
    }
    if ref[2]:
        errs = rel_grad_errors(ours[2], ref[2])
        out["grad"] = max(errs.values())
        out["n_grads"] = len(errs)
        out["visual_grads"] = sum(1 for k in errs if ".visual." in k or k.startswith("visual."))
        out["same_names"] = sorted(ours[2]) == sorted(ref[2])
    return out


def _plant_bug():
    """Positions one off: the later half of each row's mRoPE positions shifted by one."""
    from zorro_core.integrations.verl import rows as verl_rows

    original = verl_rows.mrope_of

    def wrong(position_ids, offsets):
        rows = original(position_ids, offsets)
        return (
            rows if isinstance(rows, str) else [r + (torch.arange(r.shape[1]) >= r.shape[1] // 2).long() for r in rows]
        )

    verl_rows.mrope_of = wrong
    return lambda: setattr(verl_rows, "mrope_of", original)


def case(path: str, family: str, seed: int) -> dict:
    """In a fresh process: verl's engine (no remove-padding) against zorro's (both ways), fixed and
    dynamic micro-batches, inference and training; the planted bug; what the vision tower saw."""
    import warnings

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from zorro_core.integrations.verl.cpu import build_engine, use_cpu_platform

    use_cpu_platform()
    from zorro_core.integrations.verl.engine import DedupFSDPEngine  # before verl patches its classes

    verl_engine = build_engine(FSDPEngineWithLMHead, path, use_remove_padding=False)
    spec = rows_spec(seed)
    padded = vlm_padded_batch(verl_engine.module, spec, seed)
    mask = padded["response_mask"].bool()
    results: dict = {}
    fixed = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 3}
    dynamic = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 80}
    refs = {}
    for name, mb in (("fixed", fixed), ("dynamic", dynamic)):
        for train in (False, True):
            refs[name, train] = _run(verl_engine, padded, train, use_remove_padding=False, **mb)
    # Before any engine removes padding: verl then patches Qwen2.5-VL's attention class to flash-attn.
    results["video"] = _video_fallback(verl_engine, path, family, seed)
    for rp in (True, False):
        engine = build_engine(DedupFSDPEngine, path, use_remove_padding=rp)
        patches: list[int] = []
        engine.module.model.visual.register_forward_hook(
            lambda m, args, kw, seen=patches: seen.append(int(args[0].shape[0]))
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, mb in (("fixed", fixed), ("dynamic", dynamic)):
                for train in (False, True):
                    patches.clear()
                    ours = _run(engine, padded, train, use_remove_padding=rp, **mb)
                    key = f"rp={rp} {name} train={train}"
                    results[key] = _errors(ours, refs[name, train], mask)
                    results[key]["calls"] = dict(engine.zorro_calls)
                    results[key]["patches"] = sum(patches) if not train else None
                    metrics = ours[3].get("metrics", {})
                    results[key]["metrics"] = {k: v for k, v in metrics.items() if k.startswith("zorro/")}
                    if train:
                        ref_loss = sum(refs[name, train][3].get("loss", []))
                        results[key]["loss"] = (sum(ours[3].get("loss", [])), ref_loss)
        results[f"rp={rp} warnings"] = [
            str(w.message) for w in caught if "zorro" in str(w.message) and w.category.__name__ != "SplitGroupWarning"
        ]
        if rp:
            restore = _plant_bug()
            try:
                ours = _run(engine, padded, True, use_remove_padding=rp, **fixed)
                results["planted"] = _errors(ours, refs["fixed", True], mask)
            finally:
                restore()
    # What the plain computation would encode: every image occurrence of every row.
    results["all_patches"] = sum(int(im[1].prod()) for s in spec for im in s[1])
    distinct = {tuple(im[0].flatten()[:4].tolist()): int(im[1].prod()) for s in spec for im in s[1]}
    results["distinct_patches"] = sum(distinct.values())
    return results


def _video_fallback(verl_engine, path: str, family: str, seed: int) -> dict:
    """A micro-batch holding a video goes to verl's own forward, with one warning naming the video."""
    import warnings

    from zorro_core.integrations.verl.cpu import build_engine
    from zorro_core.integrations.verl.engine import DedupFSDPEngine

    g = torch.Generator().manual_seed(seed + 1)
    video = _image(g, 2, 4, 4)
    frame = torch.tensor([1, 4, 4])
    # Qwen3-VL's processor marks each frame of a video (its get_rope_index numbers them so).
    marks = _placeholders(frame, VIDEO) * 2 if family == "qwen3_vl" else _placeholders(video[1], VIDEO)
    spec = rows_spec(seed)[:2] + [([5] + marks + [8], [], [20, 21], 9, video)]
    padded = vlm_padded_batch(verl_engine.module, spec, seed)
    engine = build_engine(DedupFSDPEngine, path, use_remove_padding=False)
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 3, "use_remove_padding": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ours = _run(engine, padded, False, **dict(meta))
    ref = _run(verl_engine, padded, False, **dict(meta))
    mask = padded["response_mask"].bool()
    return {
        "warnings": [
            str(w.message) for w in caught if "zorro" in str(w.message) and w.category.__name__ != "SplitGroupWarning"
        ],
        "calls": dict(engine.zorro_calls),
        "lp": float((ours[0] - ref[0])[mask].abs().max()),
    }


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def results(family, tmp_path_factory):
    path = model_dir(str(tmp_path_factory.mktemp("verl_vlm") / family), family)
    return launch(case, 1, path, family, 0, timeout_s=600)[0]


@pytest.mark.parametrize("rp", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("mb", ["fixed", "dynamic"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_images_served_equal_verls_engine(results, rp, mb, train):
    r = results[f"rp={rp} {mb} train={train}"]
    assert r["calls"].get("fallback", 0) == 0 and r["calls"].get("dedup", 0) > 0, r
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL, r
    if train:
        assert r["same_names"] and r["n_grads"] > 30 and r["visual_grads"] > 10 and r["grad"] <= GRAD_TOL, r
        ours, ref = r["loss"]
        assert abs(ours - ref) <= 1e-9 * max(1.0, abs(ref)), r


@pytest.mark.parametrize("rp", [True, False], ids=["remove_padding", "padded"])
def test_each_distinct_image_encoded_once_and_counted(results, rp):
    """Inference on fixed micro-batches of 3 after zorro's ordering: the tower sees each distinct image
    of a micro-batch once (never more than the distinct images of the call's micro-batches); the
    metrics count what was saved."""
    r = results[f"rp={rp} fixed train=False"]
    m = r["metrics"]
    assert m["zorro/images"][0] == 11  # 3x1 + 2x1 + 3x2 image occurrences
    assert m["zorro/image_patches"][0] == results["all_patches"]
    assert m["zorro/images_encoded"][0] < m["zorro/images"][0]
    assert m["zorro/image_patches_encoded"][0] == r["patches"] < results["all_patches"]
    assert r["patches"] >= results["distinct_patches"]
    assert not results[f"rp={rp} warnings"], results[f"rp={rp} warnings"]


def test_planted_position_bug_fails(results):
    r = results["planted"]
    assert r["lp"] > PLANTED_MIN and r["grad"] > PLANTED_MIN, r


def test_a_video_falls_back_to_verls_forward_with_one_warning(results):
    r = results["video"]
    assert len(r["warnings"]) == 1 and "video" in r["warnings"][0], r
    assert r["calls"].get("fallback", 0) == 2 and r["calls"].get("dedup", 0) == 0, r
    assert r["lp"] <= 1e-12, r


def _engine(model_type: str, sp: bool = False):
    from types import SimpleNamespace

    return SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(model_type=model_type)), use_ulysses_sp=sp)


def _micro_batch(row: dict):
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    return TensorDict({"multi_modal_inputs": NonTensorStack.from_list([NonTensorData(row)])}, batch_size=1)


IMAGE_ROW = {"pixel_values": torch.zeros(16, 24), "image_grid_thw": torch.tensor([[1, 4, 4]])}


@pytest.mark.parametrize(
    "engine,row,reason",
    [
        (("gemma3", False), IMAGE_ROW, "Gemma 3 attends bidirectionally"),
        (("qwen3_5", False), IMAGE_ROW, "not tested through verl's engine"),
        (("qwen2_vl", False), IMAGE_ROW, "Qwen2-VL is not tested"),
        (("llama", False), IMAGE_ROW, "not a vision-language family"),
        (("qwen2_5_vl", True), IMAGE_ROW, "Ulysses"),
        (("qwen3_vl", False), dict(IMAGE_ROW, pixel_values_videos=torch.zeros(32, 24)), "video"),
        (("qwen3_vl", False), dict(IMAGE_ROW, image_sizes=torch.tensor([[8, 8]])), "image_sizes"),
        (("qwen3_vl", False), {"image_grid_thw": torch.tensor([[1, 4, 4]])}, "lack pixel_values"),
    ],
    ids=["gemma3", "qwen3_5", "qwen2_vl", "text_family", "ulysses", "video", "other_key", "no_pixels"],
)
def test_what_is_not_served_names_the_reason(engine, row, reason):
    from zorro_core.integrations.verl.vision import vision_reason

    why = vision_reason(_engine(*engine), _micro_batch(row))
    assert why is not None and reason in why, why


def test_served_images_have_no_reason():
    from types import SimpleNamespace

    from zorro_core.integrations.verl.vision import vision_reason

    engine = _engine("qwen3_vl")
    engine.module.modules = lambda: iter([SimpleNamespace()])
    assert vision_reason(engine, _micro_batch(dict(IMAGE_ROW, images_seqlens=torch.tensor([16])))) is None
