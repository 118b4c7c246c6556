"""CPU seconds per decode step at batch 32, 1 thread (process_time: stable under shared load):
base vs 8 rank-16 adapters in the one-call decode vs the same adapters through the Python loop."""
import statistics, sys, tempfile, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.lora import make_adapters
from bench.model import hf_folder
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import GenerationRequest, SamplingParams

engine = LLMEngine(EngineConfig.of(max_num_seqs=32, max_loras=8, kv_cache_memory_bytes=512 << 20, num_threads=1))
model = engine.runner.model
print("stack dtype", model.lora.layers[0]["qkv"].dtype, flush=True)
with tempfile.TemporaryDirectory() as tmp:
    paths = make_adapters(hf_folder(None), Path(tmp), 8, 16)
    adapters = [engine.load_lora(f"a{i}", str(p)) for i, p in enumerate(paths)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    weights = model.decode_weights

    def cpu_per_step(loras, one_call):
        for i in range(32):
            engine.add_request(GenerationRequest(f"r{time.monotonic_ns()}-{i}", list(range(100, 140)), sp, lora=loras[i % len(loras)]))
        for _ in range(6):
            engine.step()  # prefills and a few decodes
        model.decode_weights = weights if one_call else None
        times = []
        for _ in range(24):
            t = time.process_time(); engine.step(); times.append(time.process_time() - t)
        model.decode_weights = weights
        while engine.has_unfinished():
            engine.step()
        return statistics.median(times) * 1e3

    res = {"base": [], "lora one-call": [], "lora python loop": []}
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        res["base"].append(cpu_per_step([None], True))
        res["lora one-call"].append(cpu_per_step(adapters, True))
        res["lora python loop"].append(cpu_per_step(adapters, False))
    base = statistics.mean(res["base"])
    for k, v in res.items():
        m = statistics.mean(v)
        print(f"{k}: {', '.join(f'{x:.1f}' for x in v)} ms CPU/step (mean {m:.1f}; base/this {base / m:.3f})")
