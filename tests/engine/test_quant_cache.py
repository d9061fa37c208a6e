"""Quantized weight cache (engine/weights/quant_cache*.py): streaming conversion, manifest, atomicity, staleness, loading."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_model import CancelAfter

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError
from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.weights import quant_cache_build
from clover_desk.engine.weights.checkpoint import load_model, random_state_dict, write_checkpoint
from clover_desk.engine.weights.formats import CPU_POLICY, CPU_Q6_DENSE_POLICY
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.model import GGUFLinear
from clover_desk.engine.weights.quant import (
    QuantExpertBank,
    QuantLinear,
    applied_formats,
    interleave_for_cpu,
    make_policy,
    quantize_model_,
)
from clover_desk.engine.weights.quant_cache import ensure_cache, load_from_cache, load_quantized
from clover_desk.engine.weights.quant_cache_build import build_cache
from clover_desk.engine.weights.quant_cache_files import (
    DATA_NAME,
    MANIFEST_NAME,
    cache_dir_for,
    check_cache,
    read_header,
)
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config
from tests.helpers_model import one_thread

SPECIAL = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
POLICY = make_policy()  # experts NF4, projections and lm_head INT8


_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


def write_tiny(
    path: Path,
    seed: int = 0,
    layout: str = "fused",
    hidden: int = 64,
    experts: int = 8,
    inter: int = 32,
    shards: int = 3,
    **widths: int,
) -> Path:
    text = tiny_text_config(vocab_size=128, layers=4, hidden=hidden, experts=experts, experts_per_tok=2, **widths)
    text["moe_intermediate_size"] = inter
    cd = config_dict_for("clover_moe", text, SPECIAL)
    cfg = parse_config(cd)
    sd = random_state_dict(cfg, seed=seed, expert_layout=layout, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    write_checkpoint(path, sd, cd, max_shard_bytes=total // shards + 1)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("ckpt"))


def test_cache_loads_the_same_model_as_quantizing_in_memory(ckpt: Path, tmp_path: Path) -> None:
    events: list[LoadProgress] = []
    model, report = load_quantized(ckpt, POLICY, progress=events.append, cache_root=tmp_path)
    assert report.rebuilt and report.reason.startswith("missing")
    assert (report.path / MANIFEST_NAME).exists() and (report.path / DATA_NAME).exists()
    # the reference: the plain loader, then the in-memory module swap
    ref = load_model(ckpt, dtype=torch.float32)
    quantize_model_(ref, POLICY)
    assert interleave_for_cpu(ref) > 0  # as a CPU load lays the rows out for the kernels
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    assert torch.equal(model(ids, 0, None), ref(ids, 0, None))
    # the policy table is what was applied: read it back from the loaded model
    formats = applied_formats(model)
    for name, fmt in formats.items():
        want = POLICY.format_of(name, (64, 64))
        assert fmt == (want if want in ("nf4", "int8") else "fp32"), name
    assert isinstance(model.layers[0].mlp.experts, QuantExpertBank)
    assert isinstance(model.layers[0].linear_attn.in_proj_qkv, QuantLinear)
    assert model.layers[0].linear_attn.in_proj_qkv.fmt == "int8"
    # progress: monotone bytes, an ETA, every stage, ends at the total
    stages = [e.stage for e in events]
    assert {"quantizing", "writing-cache", "reading", "done"} <= set(stages)
    quant = [e for e in events if e.stage == "quantizing"]
    assert all(a.done_bytes <= b.done_bytes for a, b in zip(quant, quant[1:]))
    assert quant[-1].done_bytes == quant[-1].total_bytes > 0
    assert any(e.eta_s is not None for e in quant) and all(e.current for e in quant)


def test_second_load_uses_the_cache(ckpt: Path, tmp_path: Path) -> None:
    load_quantized(ckpt, POLICY, cache_root=tmp_path)
    mtime = (cache_dir_for(ckpt, POLICY, tmp_path) / DATA_NAME).stat().st_mtime_ns
    _, report = load_quantized(ckpt, POLICY, cache_root=tmp_path)
    assert not report.rebuilt and report.reason == ""
    assert (report.path / DATA_NAME).stat().st_mtime_ns == mtime


def mean_kl(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(want) || softmax(got)) in nats: logits [T, V]."""
    logp_want, logp_got = want.double().log_softmax(-1), got.double().log_softmax(-1)
    return float((logp_want.exp() * (logp_want - logp_got)).sum(-1).mean())


def test_the_cpu_kernels_read_the_cache_within_the_kl_bound(ckpt: Path, tmp_path: Path) -> None:
    """The CPU kernels read the cache's NF4 experts and INT8 projections / head in place, activations rounded to
    int8 blocks (as the GGUF path, tests/engine/test_gguf.py): next-token distributions over a fixed text stay within
    1e-3 nats per token of the dequantizing path's."""
    if not cpu_quant.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_quant.reason()}")
    model, _ = load_quantized(ckpt, POLICY, cache_root=tmp_path)
    ids = torch.tensor([5, 17, 30, 41, 9, 25, 7, 66, 12, 3, 99, 114, 8, 61, 2, 77])
    with torch.no_grad():
        got = model(ids, 0, None).float()
        before = cpu_quant.set_enabled(False)
        try:
            want = model(ids, 0, None).float()
        finally:
            cpu_quant.set_enabled(before)
    assert mean_kl(got, want) <= 1e-3, mean_kl(got, want)
    assert not torch.equal(got, want)  # the kernels did run (their int8 activations round)


def test_default_location_is_beside_the_model(tmp_path: Path) -> None:
    model_dir = write_tiny(tmp_path / "m", shards=1)
    path = build_cache(model_dir, POLICY)
    assert path == model_dir.resolve() / ".clover-cache" / POLICY.hash
    assert check_cache(path, model_dir, POLICY) is None


def test_manifest_is_what_the_planner_reads(ckpt: Path, tmp_path: Path) -> None:
    from clover_desk.engine.placement.planner import manifest_from_quantized_cache

    path = build_cache(ckpt, POLICY, tmp_path / "c")
    m = json.loads((path / MANIFEST_NAME).read_text())
    assert m["version"] == 2 and m["complete"] and m["policy"]["hash"] == POLICY.hash
    assert set(m["source"]["files"]) == {p.name for p in ckpt.glob("*.safetensors")}
    header, _, _ = read_header(path / DATA_NAME)
    stored = {k: h.nbytes for k, h in header.items()}
    gu = m["tensors"]["layers.0.mlp.experts.gate_up_proj"]
    dn = m["tensors"]["layers.0.mlp.experts.down_proj"]
    assert gu["format"] == dn["format"] == "nf4" and gu["shape"] == [8, 64, 64]
    assert gu["bytes"] + dn["bytes"] == stored["layers.0.mlp.experts.packed"]  # byte-exact
    qkv = m["tensors"]["layers.0.linear_attn.in_proj_qkv.weight"]
    assert qkv["format"] == "int8" and qkv["bytes"] == sum(stored[k] for k in qkv["stored"])
    assert m["tensors"]["layers.0.mlp.gate.weight"]["format"] == "bf16"
    assert sum(t["bytes"] for t in m["tensors"].values()) == sum(stored.values())
    planner_manifest = manifest_from_quantized_cache(path / MANIFEST_NAME)
    layer_bytes = planner_manifest.expert_layer_bytes()
    assert layer_bytes[0] == stored["layers.0.mlp.experts.packed"] and len(layer_bytes) == 4


def test_per_expert_checkpoint_gives_the_same_cache(tmp_path: Path) -> None:
    fused = build_cache(write_tiny(tmp_path / "f", seed=3), POLICY, tmp_path / "cf")
    per = build_cache(write_tiny(tmp_path / "p", seed=3, layout="per_expert"), POLICY, tmp_path / "cp")
    from safetensors import safe_open

    with safe_open(str(fused / DATA_NAME), "pt") as a, safe_open(str(per / DATA_NAME), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_stale_corrupt_other_policy_and_other_checkpoint_are_reported_and_rebuilt(ckpt: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "model"
    shutil.copytree(ckpt, src)
    root = tmp_path / "cache"
    path = build_cache(src, POLICY, cache_dir_for(src, POLICY, root))
    assert check_cache(path, src, POLICY) is None
    # stale: a source shard changed (same size, new mtime)
    shard = sorted(src.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    reason = check_cache(path, src, POLICY)
    assert reason is not None and reason.startswith("stale") and shard.name in reason
    _, report = load_quantized(src, POLICY, cache_root=root)
    assert report.rebuilt and report.reason.startswith("stale")
    assert check_cache(path, src, POLICY) is None
    # corrupt: truncated weights file
    data = path / DATA_NAME
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 100)
    assert (check_cache(path, src, POLICY) or "").startswith("corrupt")
    _, report = load_quantized(src, POLICY, cache_root=root)
    assert report.rebuilt and "truncated" in report.reason
    # corrupt content (same size, header intact): only the full hash sees it
    with data.open("r+b") as f:
        f.seek(data.stat().st_size - 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert check_cache(path, src, POLICY) is None
    assert "content hash" in (check_cache(path, src, POLICY, verify="full") or "")
    _, report = load_quantized(src, POLICY, cache_root=root, verify="full")
    assert report.rebuilt
    # another policy's cache under this policy's folder
    other = make_policy(attention="nf4")
    shutil.copytree(path, cache_dir_for(src, other, root))
    assert (check_cache(cache_dir_for(src, other, root), src, other) or "").startswith("other policy")
    # another checkpoint
    other_ckpt = write_tiny(tmp_path / "other", seed=9, hidden=32)
    assert (check_cache(path, other_ckpt, POLICY) or "").startswith("other checkpoint")


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose head rows are whole Q6_K blocks (hidden 256)."""
    return write_tiny(tmp_path_factory.mktemp("wide"), seed=4, hidden=256, shards=2)


def test_a_q6_k_head_cache_is_the_gguf_paths_q6_k_head(
    wide_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's default policy stores the head as ggml Q6_K blocks ([V, N / 256 * 210] uint8, no separate
    scales; converted in chunks of rows here); the loaded head multiplies like the GGUF path's GGUFLinear on the
    blocks of the same weight (same kernel: the same bits, or the same dequantized product without the kernels),
    the whole model equals quantizing in memory, and the planner reads the manifest's bytes."""
    from clover_desk.engine.placement.planner import manifest_from_quantized_cache

    monkeypatch.setattr(quant_cache_build, "CHUNK_BYTES", 16 * 256 * 2)  # 16 bf16 rows of the head per chunk
    model, report = load_quantized(wide_ckpt, cache_root=tmp_path)  # no policy: the CPU's default
    assert report.path.name == CPU_POLICY.hash
    m = json.loads((report.path / MANIFEST_NAME).read_text())
    head = m["tensors"]["lm_head.weight"]
    header, _, _ = read_header(report.path / DATA_NAME)
    assert head["format"] == "q6_k" and head["bytes"] == 128 * 210
    assert header["lm_head.codes"].shape == (128, 210) and header["lm_head.scales"].shape == (0,)
    assert m["tensors"]["layers.0.linear_attn.in_proj_qkv.weight"]["format"] == "int8"
    assert manifest_from_quantized_cache(report.path / MANIFEST_NAME).total_bytes() == sum(
        h.nbytes for h in header.values())
    ref = load_model(wide_ckpt, dtype=torch.float32)
    file_head = GGUFLinear(gq.quantize(ref.lm_head.weight.data, gq.Q6_K), gq.Q6_K, 256)
    quantize_model_(ref, CPU_POLICY)
    interleave_for_cpu(ref)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt == "q6_k"
    assert torch.equal(model.lm_head.codes, file_head.raw)
    h = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    with torch.no_grad():
        assert torch.equal(model.lm_head(h), file_head(h))
        assert torch.equal(model(ids, 0, None), ref(ids, 0, None))
        before = cpu_quant.set_enabled(False)
        try:
            torch.testing.assert_close(model.lm_head(h), file_head(h), rtol=1e-6, atol=1e-6)
        finally:
            cpu_quant.set_enabled(before)


@pytest.fixture(scope="module")
def dense_wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose every dense projection has rows of whole Q6_K blocks: hidden 256, attention and
    Gated DeltaNet values 4 x 64, shared expert 256 wide."""
    return write_tiny(tmp_path_factory.mktemp("dense-wide"), seed=5, hidden=256, shards=2, head_dim=64,
                      linear_head_dim=64, shared_intermediate=256)


def test_the_q6_k_dense_policy_stores_every_projection_as_the_gguf_paths_q6_k(dense_wide_ckpt: Path,
                                                                              tmp_path: Path) -> None:
    """``CPU_Q6_DENSE_POLICY`` stores the attention, Gated DeltaNet and shared-expert projections (and the head) as
    ggml Q6_K blocks: each loaded projection holds the blocks gguf-py's quantizer writes for the same weight and
    multiplies like the GGUF path's GGUFLinear on them (same kernel, same bits); the whole model equals quantizing
    in memory with that policy; experts stay NF4, the router and GDN a/b projections unquantized."""
    model, report = load_quantized(dense_wide_ckpt, CPU_Q6_DENSE_POLICY, cache_root=tmp_path)
    assert report.path.name == CPU_Q6_DENSE_POLICY.hash != CPU_POLICY.hash
    formats = {k: v["format"] for k, v in json.loads((report.path / MANIFEST_NAME).read_text())["tensors"].items()}
    kept = ("in_proj_a.weight", "in_proj_b.weight")  # GDN beta / decay inputs: [Hv, D], unquantized
    projections = [k for k in formats if "_proj" in k and ("attn." in k or "shared_expert." in k)]
    assert len(projections) == 3 * 5 + 4 + 4 * 3  # GDN qkv, z, a, b, out; q, k, v, o; shared gate, up, down
    assert {k: formats[k] for k in projections if not k.endswith(kept)} == {
        k: "q6_k" for k in projections if not k.endswith(kept)}
    assert formats["lm_head.weight"] == "q6_k" and formats["layers.0.mlp.experts.gate_up_proj"] == "nf4"
    assert {formats["layers.0.mlp.gate.weight"], formats["layers.0.linear_attn.in_proj_a.weight"]} == {"bf16"}
    ref = load_model(dense_wide_ckpt, dtype=torch.float32)
    refs = dict(ref.named_modules())
    h = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    checked = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, QuantLinear) or mod.fmt != "q6_k":
                continue
            w = refs[name].weight.data  # [O, N], N a multiple of 256
            file_linear = GGUFLinear(gq.quantize(w, gq.Q6_K), gq.Q6_K, w.shape[1])
            assert torch.equal(mod.codes, file_linear.raw), name
            x = h.repeat(1, w.shape[1] // 256)  # [5, N]
            assert torch.equal(mod(x), file_linear(x)), name
            checked += 1
        assert checked == 3 * 3 + 4 + 4 * 3 + 1  # the projections above and the head
        quantize_model_(ref, CPU_Q6_DENSE_POLICY)
        ids = torch.tensor([5, 6, 7, 8, 9, 10])
        assert torch.equal(model(ids, 0, None), ref(ids, 0, None))


def test_a_cache_of_the_old_policy_still_loads_and_the_new_one_says_why_it_is_built(
    wide_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache built when the CPU's default head was INT8 (``make_policy()``) keeps its folder: it loads under its
    own policy, unchanged; the CPU default builds its own folder beside it and the log names the old one."""
    old = build_cache(wide_ckpt, POLICY, cache_dir_for(wide_ckpt, POLICY, tmp_path))
    model, report = load_quantized(wide_ckpt, POLICY, cache_root=tmp_path)
    assert not report.rebuilt and report.path == old and model.lm_head.fmt == "int8"
    with caplog.at_level(logging.WARNING, logger="clover_desk.engine.weights.quant_cache"):
        new = ensure_cache(wide_ckpt, cache_root=tmp_path, device="cpu")
    assert new.rebuilt and new.reason.startswith("missing") and new.path.name == CPU_POLICY.hash
    assert str(old) in caplog.text and POLICY.name in caplog.text
    assert ensure_cache(wide_ckpt, cache_root=tmp_path, device="cuda:0").path == old  # a GPU's default: INT8
    assert load_from_cache(old, wide_ckpt).lm_head.fmt == "int8"
    assert load_from_cache(new.path, wide_ckpt).lm_head.fmt == "q6_k"


def test_cancel_leaves_nothing_behind(ckpt: Path, tmp_path: Path) -> None:
    progress = CancelAfter(5)
    target = tmp_path / "root" / POLICY.hash
    with pytest.raises(CancelledError, match="cancelled"):
        build_cache(ckpt, POLICY, target, progress=progress, cancel=progress.cancel)
    assert not target.exists()
    assert list((tmp_path / "root").iterdir()) == []


_KILLED_SCRIPT = """
import os, signal, sys
from clover_desk.engine.weights.quant import make_policy
from clover_desk.engine.weights.quant_cache_build import build_cache
n = 0
def progress(p):
    global n
    n += 1
    if n == 6:
        os.kill(os.getpid(), signal.SIGKILL)
build_cache(sys.argv[1], make_policy(), sys.argv[2], progress=progress)
"""


def test_killed_conversion_leaves_no_cache_that_looks_complete(ckpt: Path, tmp_path: Path) -> None:
    target = tmp_path / "root" / POLICY.hash
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SCRIPT, str(ckpt), str(target)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    leftovers = list((tmp_path / "root").iterdir())
    assert leftovers and all(p.name.startswith(".tmp-") for p in leftovers)  # the half-written folder only
    assert (check_cache(target, ckpt, POLICY) or "").startswith("missing")
    model, report = load_quantized(ckpt, POLICY, cache_root=tmp_path / "root")
    assert report.rebuilt
    assert [p.name for p in (tmp_path / "root").iterdir()] == [POLICY.hash]  # leftover removed


_RSS_SCRIPT = """
import sys, threading, time, psutil, torch
torch.set_num_threads(1)
from clover_desk.engine.weights.quant import make_policy, quantize_tensor
from clover_desk.engine.weights.quant_cache_build import build_cache
quantize_tensor(torch.randn(64, 64), "nf4")  # load bitsandbytes' libraries before the baseline (a constant)
quantize_tensor(torch.randn(64, 64), "int8")
proc = psutil.Process()
base = proc.memory_info().rss
peak = base
stop = False
def watch():
    global peak
    while not stop:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=watch); t.start()
def progress(p):
    global peak
    peak = max(peak, proc.memory_info().rss)
build_cache(sys.argv[1], make_policy(), sys.argv[2], progress=progress)
stop = True; t.join()
print(peak - base)
"""


def test_conversion_peak_memory_is_bounded(tmp_path: Path) -> None:
    model_dir = write_tiny(tmp_path / "big", hidden=128, experts=64, inter=128, shards=2)  # ~30 MB of bf16
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert size > 20 * 2**20
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(model_dir), str(tmp_path / "c" / POLICY.hash)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.strip().splitlines()[-1])
    # one expert / one chunk at a time: far below the checkpoint (which would be > 100 % if loaded whole)
    assert growth < 0.5 * size, f"peak RSS grew by {growth / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB checkpoint"


@pytest.mark.parametrize("where", ["experts", "lm_head codes", "every tensor, one byte"])
def test_altered_cache_bytes_are_caught_on_load_and_rebuilt(ckpt: Path, tmp_path: Path, where: str) -> None:
    """A cache whose data changed but whose size and header did not (half a tensor zeroed, a byte flipped) passes the
    cheap check; the per-tensor crc32 read with the data catches it, the cache is rebuilt and the model loaded from
    it equals the one from the intact cache."""
    import shutil

    from clover_desk.engine.weights.quant_cache import CacheDamaged, load_from_cache

    src = shutil.copytree(ckpt, tmp_path / "model")
    root = tmp_path / "cache"
    good, report = load_quantized(src, POLICY, cache_root=root)
    data = report.path / DATA_NAME
    header, _, _ = read_header(data)
    keys = {"experts": ["layers.1.mlp.experts.packed"], "lm_head codes": ["lm_head.codes"], "every tensor, one byte": list(header)}[where]
    with data.open("r+b") as f:
        for key in keys:
            h = header[key]
            if where == "every tensor, one byte":
                f.seek(h.begin)
                byte = f.read(1)
                f.seek(h.begin)
                f.write(bytes([byte[0] ^ 0x01]))
            else:
                f.seek(h.begin)
                f.write(bytes(h.nbytes // 2))  # zero the first half
    assert check_cache(report.path, src, POLICY) is None  # size and header unchanged: the cheap check passes
    with pytest.raises(CacheDamaged, match="crc32 mismatch"):
        load_from_cache(report.path, src, rebuild_on_damage=False)
    model = load_from_cache(report.path, src)  # caught, rebuilt, read again
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    assert torch.equal(model(ids, 0, None), good(ids, 0, None))
    load_from_cache(report.path, src, rebuild_on_damage=False)  # the rebuilt cache is intact


# ---- caches written before the conversion refused NaN / infinite weights (issue 31) -----------------------------


def _nan_checkpoint(path: Path) -> tuple[Path, str]:
    """The tiny checkpoint with one NaN in an expert bank, written as a fresh checkpoint; (folder, tensor name)."""
    text = tiny_text_config(vocab_size=128, layers=4, hidden=64, experts=8, experts_per_tok=2)
    text["moe_intermediate_size"] = 32
    cd = config_dict_for("clover_moe", text, SPECIAL)
    sd = random_state_dict(parse_config(cd), seed=0, expert_layout="fused", dtype=torch.bfloat16)
    name = "layers.2.mlp.experts.gate_up_proj"
    sd[name][3, 1, 2] = float("nan")
    write_checkpoint(path, sd, cd, max_shard_bytes=1 << 20)
    return path, name


def _as_written_before_the_check(cache: Path) -> None:
    """The manifest as the format-2 converter wrote it before it checked the weights (no "checks")."""
    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    manifest.pop("checks", None)
    (cache / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_cache_written_before_the_finite_check_holding_a_nan_is_rebuilt_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clover_desk.engine.weights.quant_cache_files as quant_cache_files
    from clover_desk.engine.errors import CheckpointError

    src, name = _nan_checkpoint(tmp_path / "model")
    root = tmp_path / "cache"
    cache = cache_dir_for(src, POLICY, root)
    with monkeypatch.context() as old:  # the converter as it was: no check of the values
        old.setattr(quant_cache_files, "check_finite", lambda *args, **kwargs: None)
        build_cache(src, POLICY, cache)
    _as_written_before_the_check(cache)
    reason = check_cache(cache, src, POLICY)
    assert reason is not None and reason.startswith("unchecked: ") and "NaN and infinite values" in reason
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '\S*{name}' holds 1 NaN value"):
        load_quantized(src, POLICY, cache_root=root)
    assert check_cache(cache, src, POLICY) is not None  # never used, never marked checked


def test_a_healthy_cache_written_before_the_finite_check_is_rebuilt_once(ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    good, report = load_quantized(ckpt, POLICY, cache_root=root)
    assert json.loads(report.manifest_path.read_text())["checks"] == ["finite"]
    _as_written_before_the_check(report.path)
    again, report = load_quantized(ckpt, POLICY, cache_root=root)
    assert report.rebuilt and report.reason.startswith("unchecked")
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    assert torch.equal(again(ids, 0, None), good(ids, 0, None))
    _, report = load_quantized(ckpt, POLICY, cache_root=root)
    assert not report.rebuilt
