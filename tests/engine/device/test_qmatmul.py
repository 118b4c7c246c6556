"""Our quantized matmuls (engine/device/csrc/qmatmul_x86.cpp): exact packing of the GGUF formats, the
kernels against a float64 reference of the same arithmetic, rows independent of their batch, the
path each CPU gets, and the engine served on them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine import step as step_module
from engine.config import EngineConfig, WeightFormat
from engine.device import quant
from engine.device.loader import gguf_tensor_infos, is_q4_1_gguf
from engine.device.models.decoder import DecoderModel
from engine.device.native import native_kernels
from engine.device.platform import CpuIsa, cpu_isa
from engine.device.quant import Linear, dequantize, pack_q4, pack_q8
from engine.llm_engine import LLMEngine
from engine.resolve import qmatmul_available, resolve_engine_dtype, resolve_kv_dtype, resolve_weight_format
from engine.types import GenerationRequest, TokenLogprob
from tests.engine.helpers import compare_one_call_decode, greedy, run_all, tiny_engine, tokens_of
from tests.tiny_model import make_tiny_model, snap_to_q4_1

CPU = torch.device("cpu")
HAS_QMATMUL = cpu_isa() >= CpuIsa.AVX2 and qmatmul_available("auto", CPU)
needs_qmatmul = pytest.mark.skipif(
    not HAS_QMATMUL, reason=f"the int8 kernels need AVX2, FMA and F16C (this CPU's level: {cpu_isa().name})"
)


def snap_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded onto a Q8_0 grid (per 32 along K: w = d * q, q in -127..127, d in fp16)."""
    g = weight.float().view(weight.shape[0], -1, 32)
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    return ((g / d).round().clamp(-127, 127) * d).view_as(weight)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_gguf_groups_are_packed_exactly_and_unpack_to_the_same_weights(kind: str) -> None:
    torch.manual_seed(0)
    raw = torch.randn(100, 96) * 0.05  # 100 rows: the last block of 8 is padded
    snapped = snap_to_q4_1(raw) if kind == "q4" else snap_to_q8_0(raw)
    pack = pack_q4 if kind == "q4" else pack_q8
    packed = pack(snapped)
    assert packed.max_abs_error == 0.0 and packed.packed.shape == (13, 3, 160 if kind == "q4" else 272)
    assert torch.equal(dequantize(packed), snapped)
    assert torch.equal(pack(dequantize(packed)).packed, packed.packed)
    lossy = pack(raw)  # weights off the grid: within half a step of the group's range
    steps = raw.view(100, 3, 32)
    span = steps.amax(-1) - steps.amin(-1) if kind == "q4" else 2 * steps.abs().amax(-1)
    assert 0 < lossy.max_abs_error <= (span / (15 if kind == "q4" else 254)).max().item() * 0.51


def test_a_weight_must_come_in_whole_groups() -> None:
    with pytest.raises(ValueError, match="whole groups of 32"):
        pack_q4(torch.randn(8, 40))


@needs_qmatmul
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize(("ratio", "bound"), [(0.0, 1e-4), (quant.OUTLIER_RATIO, 5e-3), (math.inf, 3e-2)])
def test_kernels_compute_the_quantized_product(kind: str, ratio: float, bound: float) -> None:
    torch.manual_seed(0)
    ops = native_kernels()
    op = ops.q4_linear if kind == "q4" else ops.q8_linear
    weight = (pack_q4 if kind == "q4" else pack_q8)(torch.randn(100, 1536) * 0.05)
    exact = dequantize(weight).double()
    bias = torch.randn(100)
    for rows in (1, 2, 3, 4, 5, 7, 33):
        x = torch.rand(rows, 1536) * 2 - 1
        x[:, 7] *= 40  # an outlier channel, as LLM activations have
        got = op(x, weight.packed, 100, bias, ratio).double()
        want = quant.quantize_activations(x, ratio).double() @ exact.t() + bias.double()
        assert got.shape == (rows, 100)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        # The activations' own rounding: 15 bits in every group (ratio 0), in the outlier's groups
        # only, or 8 bits everywhere.
        vs_float = (got - (x.double() @ exact.t() + bias.double())).abs().max() / want.abs().max()
        assert vs_float < bound


@needs_qmatmul
@pytest.mark.parametrize("ratio", [0.0, quant.OUTLIER_RATIO, math.inf])
def test_a_row_does_not_depend_on_its_batch(ratio: float) -> None:
    """So a prompt gets the same logits prefilled whole, in chunks, or decoded beside others."""
    torch.manual_seed(0)
    layer = Linear.build(torch.randn(72, 576) * 0.05, quant="q4")
    layer.outlier_ratio = ratio
    x = torch.randn(20, 576)  # from 16 rows the AVX-512 VNNI tiles take two blocks at a time
    x[::2, 40] *= 30  # outlier groups in some rows only: tiles mix 8- and 15-bit rows
    together = layer(x)
    for i in range(20):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(layer(x[3:9]), together[3:9])
    # Past 48 rows a batch runs in chunks of rows, items that threads take from a counter: 100 rows
    # run as 48, 48 and 4, and each row still gets its own result.
    many = torch.randn(100, 576)
    many[::3, 7] *= 30
    assert torch.equal(layer(many)[[0, 37, 38, 71, 72, 99]], layer(many[[0, 37, 38, 71, 72, 99]]))
    # No rows (the LM head of a step whose prefill chunks complete no sequence): no result.
    assert layer(many[:0]).shape == (0, 72)


@needs_qmatmul
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_matmul_helpers_give_the_same_results_also_when_work_is_taken_back(kind: str) -> None:
    """With helpers (engine/device/csrc/steal_pool.h) a step of 1-4 rows gets the OpenMP path's results
    bit for bit; so it does when a helper holds the work it took (as a descheduled one would) and
    the calling thread takes it back. Larger steps keep OpenMP."""
    ops = native_kernels()
    torch.manual_seed(0)
    raw = torch.randn(2000, 576) * 0.05  # 250 blocks of 8 rows: runs of several blocks
    w = (pack_q4 if kind == "q4" else pack_q8)(raw).packed
    op = ops.q4_linear if kind == "q4" else ops.q8_linear
    try:
        for m in (1, 2, 3, 4, 5):
            x = torch.randn(m, 576)
            x[:, 40] *= 30  # outlier groups: the 15-bit path too
            ops.set_matmul_helpers(0)
            expected = op(x, w, 2000, None, quant.OUTLIER_RATIO)
            ops.set_matmul_helpers(1)
            assert torch.equal(op(x, w, 2000, None, quant.OUTLIER_RATIO), expected)
            before = ops.hold_matmul_helpers(True)
            try:
                held = op(x, w, 2000, None, quant.OUTLIER_RATIO)
            finally:
                taken_back = ops.hold_matmul_helpers(False) - before
            assert torch.equal(held, expected)
            # Held, the caller starts once the helper took a run, and takes back that run and no
            # other (taking back its own runs counted them twice, and it returned while a helper
            # still stored into the output); 5 rows run on OpenMP, no helper involved.
            assert taken_back == (1 if m <= 4 else 0)
    finally:
        ops.hold_matmul_helpers(False)
        ops.set_matmul_helpers(0)


@needs_qmatmul
def test_a_helper_that_resumes_after_its_job_ended_stores_nothing() -> None:
    """A helper descheduled right after claiming a job's run, while the caller took that run back,
    ended the job and ran the next one (whose own helper took the same run): resumed, it finds a
    later job's state on the run and drops it, and both outputs stay as computed: it must not store
    into the ended job's output, which the engine may have freed."""
    ops = native_kernels()
    torch.manual_seed(0)
    w = pack_q4(torch.randn(2000, 576) * 0.05).packed  # 2,000 outputs: no narrowing copy of the result
    x1, x2 = torch.randn(2, 576), torch.randn(2, 576)
    try:
        ops.set_matmul_helpers(0)
        want1, want2 = (ops.q4_linear(x, w, 2000, None, quant.OUTLIER_RATIO) for x in (x1, x2))
        ops.set_matmul_helpers(2)
        ops.hold_matmul_helpers(True, True)
        try:
            # One helper holds the first run of each job, just claimed; the caller takes it back.
            got1 = ops.q4_linear(x1, w, 2000, None, quant.OUTLIER_RATIO)
            got2 = ops.q4_linear(x2, w, 2000, None, quant.OUTLIER_RATIO)
        finally:
            ops.hold_matmul_helpers(False)
        ops.set_matmul_helpers(1)  # joins both helpers, each past its job
        assert torch.equal(got1, want1) and torch.equal(got2, want2)
    finally:
        ops.hold_matmul_helpers(False)
        ops.set_matmul_helpers(0)


_AVX2_PROBE = """
import sys, torch
from engine.device.native import native_kernels
ops = native_kernels()
assert ops.qmatmul_isa() == "avx2", ops.qmatmul_isa()
ops = {"q4": ops.q4_linear, "q8": ops.q8_linear}
torch.save([ops[kind](x, w, n, None, r) for kind, x, w, n, r in torch.load(sys.argv[1])], sys.argv[2])
"""


@pytest.mark.skipif(
    cpu_isa() < CpuIsa.AVX512_VNNI or not HAS_QMATMUL,
    reason=f"the VNNI tiles need AVX-512 VNNI (this CPU's level: {cpu_isa().name})",
)
def test_the_vnni_tiles_give_the_avx2_tiles_results_bit_for_bit(tmp_path: Path) -> None:
    """Both sum the same integers exactly, then scale them alike: a CPU's level changes the
    speed, never a token. The AVX2 tiles run in a process capped to that level (its own build)."""
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    cases: list[tuple[Any, ...]] = []
    for kind, pack in (("q4", pack_q4), ("q8", pack_q8)):
        w = pack(torch.randn(100, 576) * 0.05).packed  # 13 blocks of 8: pairs and an odd one
        for rows in (11, 40):  # one block at a time, then two (from 16 rows)
            x = torch.randn(rows, 576)
            x[::2, 40] *= 30  # outlier groups in some rows: both the 8- and the 15-bit products
            cases.append((kind, x, w, 100, quant.OUTLIER_RATIO))
    torch.save(cases, tmp_path / "case.pt")
    env = {**os.environ, "BATCHGATE_MAX_CPU_ISA": "avx2"}
    probe = [sys.executable, "-c", _AVX2_PROBE, str(tmp_path / "case.pt"), str(tmp_path / "avx2.pt")]
    done = subprocess.run(probe, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    avx2 = torch.load(tmp_path / "avx2.pt")
    ops = native_kernels()
    assert ops.qmatmul_isa() == "avx512_vnni"
    for got, (kind, x, w, n, r) in zip(avx2, cases, strict=True):
        assert torch.equal((ops.q4_linear if kind == "q4" else ops.q8_linear)(x, w, n, None, r), got)


def test_the_path_matches_the_cpu() -> None:
    """Runs everywhere: our kernels exactly where the CPU level has AVX2 and they build, on the
    VNNI tiles exactly where it has AVX-512 VNNI."""
    if cpu_isa() < CpuIsa.AVX2:
        assert not qmatmul_available("auto", CPU)
    else:
        assert qmatmul_available("auto", CPU) == bool(native_kernels().has_qmatmul())
        want = "avx512_vnni" if cpu_isa() >= CpuIsa.AVX512_VNNI else "avx2"
        assert native_kernels().qmatmul_isa() == (want if HAS_QMATMUL else "")
    assert not qmatmul_available("torch", CPU)
    assert not qmatmul_available("auto", torch.device("cuda"))


def test_weight_format_per_setting_dtype_and_cpu(tiny_model_dir: Path) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert is_q4_1_gguf(None) and not is_q4_1_gguf(str(tiny_model_dir))  # the bundled file, a tiny one
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig.of(quantization="int3")
    ours = WeightFormat(layers="q4", head="q8")
    assert resolve_weight_format(EngineConfig(), CPU, f32, True) == ours  # AVX2: the bundled Q4_1
    assert resolve_weight_format(EngineConfig(), CPU, f32, False) == WeightFormat()  # no kernels
    assert resolve_weight_format(EngineConfig(), CPU, bf16, True) == WeightFormat(int4_max_rows=8)
    assert resolve_weight_format(EngineConfig.of(dtype="float32"), CPU, f32, True) == WeightFormat()  # parity
    assert resolve_weight_format(EngineConfig.of(model=str(tiny_model_dir)), CPU, f32, True) == WeightFormat()
    int8 = EngineConfig.of(model=str(tiny_model_dir), dtype="float32", quantization="int8")
    assert resolve_weight_format(int8, CPU, f32, True) == WeightFormat(layers="q8", head="q8")
    int4 = EngineConfig.of(model=str(tiny_model_dir), quantization="int4")
    assert resolve_weight_format(int4, CPU, f32, True) == ours
    with pytest.raises(ValueError, match="native kernels"):
        resolve_weight_format(int8, CPU, f32, False)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        resolve_weight_format(EngineConfig.of(quantization="int8", tensor_parallel_size=2), CPU, f32, True)
    assert resolve_weight_format(EngineConfig.of(quantization="none"), CPU, f32, True) == WeightFormat()
    # dtype "auto": the bundled Q4_1 on our kernels (float32) wherever they run, native bf16 or not.
    assert resolve_engine_dtype(EngineConfig(), CPU, bf16, True) == f32
    assert resolve_engine_dtype(EngineConfig(), CPU, bf16, False) == bf16  # no kernels
    assert resolve_engine_dtype(EngineConfig.of(dtype="bfloat16"), CPU, bf16, True) == bf16
    assert resolve_engine_dtype(EngineConfig.of(quantization="none"), CPU, bf16, True) == bf16
    assert resolve_engine_dtype(EngineConfig.of(model=str(tiny_model_dir)), CPU, bf16, True) == bf16
    assert resolve_engine_dtype(EngineConfig.of(tensor_parallel_size=2), CPU, bf16, True) == bf16


def test_kv_cache_dtype_per_setting_and_device() -> None:
    """auto: bf16 under float32 activations on our int8 kernels (CPU), else the engine's dtype; an
    explicit dtype only where the kernels and torch ops of engine/device/models/decoder.py read it."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    cuda = torch.device("cuda")
    auto = EngineConfig()
    assert resolve_kv_dtype(auto, f32, True, CPU) == bf16
    assert resolve_kv_dtype(auto, f32, False, CPU) == f32  # the float32 parity mode stays exact
    assert resolve_kv_dtype(auto, bf16, False, CPU) == bf16
    assert resolve_kv_dtype(auto, f32, True, cuda) == f32
    assert resolve_kv_dtype(EngineConfig.of(kv_cache_dtype="float32"), f32, True, CPU) == f32
    assert resolve_kv_dtype(EngineConfig.of(kv_cache_dtype="bfloat16"), f32, False, CPU) == bf16
    for setting, dtype, device in (("float32", bf16, CPU), ("float16", f32, CPU), ("bfloat16", f32, cuda)):
        with pytest.raises(ValueError, match=f"kv_cache_dtype {setting} needs"):
            resolve_kv_dtype(EngineConfig.of(kv_cache_dtype=setting), dtype, True, device)
    assert resolve_kv_dtype(EngineConfig.of(kv_cache_dtype="float16"), f16, False, CPU) == f16
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig.of(kv_cache_dtype="fp8")


@needs_qmatmul
def test_a_bf16_cache_holds_twice_the_blocks_and_serves_alike_on_the_kernels_and_torch_ops(
    tmp_path: Path, real_model_dir: Path
) -> None:
    """On the int8 kernels the cache is bf16 by default (twice the blocks in the same memory); a bf16
    cache under float32 activations gives the same tokens and logprobs through the native kernels
    as through the torch ops, prefilled whole or in chunks."""
    q4 = make_tiny_model(tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256)
    memory = 1 << 20
    native = tiny_engine(q4, quantization="int4", kv_cache_memory_bytes=memory)
    wide = tiny_engine(q4, quantization="int4", kv_cache_memory_bytes=memory, kv_cache_dtype="float32")
    assert native.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert wide.runner.kv_caches[0][0].dtype == torch.float32
    assert native.block_manager.num_blocks == 2 * wide.block_manager.num_blocks
    dense = make_tiny_model(tmp_path / "dense", real_model_dir)
    sampling = greedy(10, logprobs=True, top_logprobs=2)
    requests = [
        GenerationRequest("a", list(range(200, 237)), sampling),
        GenerationRequest("b", [5, 6], sampling),
    ]
    got = {}
    for backend in ("native", "torch"):
        engine = tiny_engine(dense, kv_cache_dtype="bfloat16", kernels=backend, max_num_batched_tokens=8)
        assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
        got[backend] = {
            key: [lp for o in outs for lp in o.logprobs] for key, outs in run_all(engine, requests).items()
        }
    for key, lps in got["native"].items():
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in got["torch"][key]]
        for mine, theirs in zip(lps, got["torch"][key], strict=True):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def _write_gguf(path: Path, layer_type: str) -> Path:
    """A GGUF file with string, array and number metadata (a vocabulary of strings, as a model's),
    a 1-D and a 2-D layer tensor, and an F32 embedding."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("general.flag", True)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    if layer_type == "Q4_1":  # one block of 32: a scale, a minimum (fp16) and 16 bytes of nibbles
        raw = np.zeros((4, 20), dtype=np.uint8)
        writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
    else:
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("layer_type", ["Q4_1", "F32"])
def test_the_gguf_header_reader_agrees_with_gguf_s_own(tmp_path: Path, layer_type: str) -> None:
    from gguf import GGUFReader

    path = _write_gguf(tmp_path / "m.gguf", layer_type)
    theirs = [(t.name, len(t.shape), int(t.tensor_type)) for t in GGUFReader(str(path)).tensors]
    assert gguf_tensor_infos(path) == theirs
    assert is_q4_1_gguf(str(path)) == (layer_type == "Q4_1")


@needs_qmatmul
def test_engine_on_the_int8_kernels_serves_frees_and_keeps_prefill_consistent(
    tmp_path: Path, real_model_dir: Path
) -> None:
    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    engine = tiny_engine(model, quantization="int4")
    layers = engine.runner.model.layers
    assert all(layer.qkv.quant is not None and layer.qkv.weight is None for layer in layers)
    assert engine.runner.model.lm_head.quant is not None
    dense = tiny_engine(model, quantization="none")
    prompt = list(range(200, 237))
    # Prefilled whole, or in chunks of 8 beside a decoding sequence: the same tokens.
    whole = tokens_of(run_all(engine, [GenerationRequest("a", prompt, greedy(12))])[("a", 0)])
    chunked = tiny_engine(model, quantization="int4", max_num_batched_tokens=8)
    outs = run_all(
        chunked, [GenerationRequest("b", [5, 6, 7], greedy(20)), GenerationRequest("a", prompt, greedy(12))]
    )
    assert tokens_of(outs[("a", 0)]) == whole
    assert chunked.block_manager.num_free_blocks == chunked.block_manager.num_blocks
    # Against the float weights (the head requantized to Q8_0 here): the same first choice. The
    # real model's agreement is measured by bench/quant_parity.py.
    ref = tokens_of(run_all(dense, [GenerationRequest("a", prompt, greedy(12))])[("a", 0)])
    assert whole[0] == ref[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@needs_qmatmul
def test_small_steps_on_each_candidate_give_the_same_tokens(
    tmp_path: Path, real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ways a small step may run where the engine's threads take every CPU (engine/device/runner.py:
    one thread, OpenMP on all, the engine thread with matmul helpers) change only who computes:
    the same greedy tokens on each."""
    from engine.device import runner as runner_module
    from engine.device.runner import StepThreads

    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    monkeypatch.setattr(runner_module, "_all_cpus_taken", lambda n: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = tiny_engine(model, quantization="int4", kernels="native")
        candidates = engine.runner.small_step_threads.candidates
        assert candidates == (StepThreads(1), StepThreads(2), StepThreads(1, 1))
        answers = []
        for i, candidate in enumerate(candidates):
            monkeypatch.setattr(engine.runner.small_step_threads, "threads", lambda c=candidate: c)
            outs = run_all(engine, [GenerationRequest(f"r{i}", list(range(200, 237)), greedy(12))])
            answers.append(tokens_of(outs[(f"r{i}", 0)]))
    finally:
        torch.set_num_threads(threads)
        native_kernels().set_caller_threads(threads)
        native_kernels().set_matmul_helpers(0)
    assert answers[0] == answers[1] == answers[2]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@needs_qmatmul
def test_linear_on_our_kernels_keeps_no_float_copy() -> None:
    weight = snap_to_q4_1(torch.randn(24, 64))
    layer = Linear.build(weight, torch.zeros(24), quant="q4")
    assert layer.weight is None and layer.packed is None and layer.int4 is None
    x = torch.randn(3, 64)
    assert (layer(x) - F.linear(x, weight)).abs().max() < 0.05 * F.linear(x, weight).abs().max()


@needs_qmatmul
def test_a_decode_step_in_one_native_call_gives_the_same_logits_bit_for_bit(
    tmp_path: Path, real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    engine = tiny_engine(model, quantization="int4")
    assert tiny_engine(model, quantization="none").runner.model.decode_weights is None  # float weights
    compared = compare_one_call_decode(engine, monkeypatch)
    # Sequences of different lengths, joining at different steps: decode rows over varied contexts.
    requests = [
        GenerationRequest(f"r{i}", list(range(100 + i, 120 + 7 * i)), greedy(10 + i)) for i in range(4)
    ]
    run_all(engine, requests)
    assert len(compared) >= 8 and all(compared)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@needs_qmatmul
def test_a_short_prefill_in_the_one_native_call_gives_the_same_logprobs_however_it_is_split(
    tmp_path: Path, real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prefill runs its tokens as decode rows of the one-call layers
    (engine/device/models/decoder.py): prefilled whole, in chunks of 5 beside a decoding sequence,
    or after a prefix-cache hit, a prompt's logprobs are the same bit for bit, and no step goes
    through the Python layer loop."""
    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    layer_loops: list[int] = []
    python_layers = DecoderModel._layers

    def counted(self: DecoderModel, *args: Any) -> Any:
        layer_loops.append(1)
        return python_layers(self, *args)

    monkeypatch.setattr(DecoderModel, "_layers", counted)
    prompt = list(range(200, 237))
    sampling = greedy(6, logprobs=True, top_logprobs=5)

    def logprobs(engine: LLMEngine, request_id: str, partner: bool = False) -> list[TokenLogprob]:
        requests = [GenerationRequest(request_id, prompt, sampling)]
        if partner:  # a sequence already decoding: the chunks share steps with its decode rows
            requests.insert(0, GenerationRequest(f"{request_id}-partner", [5, 6, 7], greedy(20)))
        return [lp for out in run_all(engine, requests)[(request_id, 0)] for lp in out.logprobs]

    engine = tiny_engine(model, quantization="int4")
    whole = logprobs(engine, "whole")
    cached = logprobs(engine, "cached")  # the same prompt again: its full blocks from the cache
    assert engine.block_manager.num_hit_tokens == 36
    chunked = logprobs(tiny_engine(model, quantization="int4", max_num_batched_tokens=5), "chunked", True)
    assert len(whole) == 6 and whole == cached == chunked
    assert not layer_loops
    # Past the bound on attention work a chunk of at most ONE_CALL_PREFILL_TOKENS still runs in
    # the one call (here the prompt's last token, after the cached blocks), bit for bit.
    monkeypatch.setattr(step_module, "ONE_CALL_PREFILL_CONTEXT", 0)
    assert logprobs(engine, "deep") == whole and not layer_loops
    # Past both bounds the Python layer loop (SDPA) prefills it: the same first token.
    monkeypatch.setattr(step_module, "ONE_CALL_PREFILL_TOKENS", 0)
    looped = logprobs(engine, "looped")
    assert layer_loops and looped[0].token_id == whole[0].token_id
    assert abs(looped[0].logprob - whole[0].logprob) < 0.05
