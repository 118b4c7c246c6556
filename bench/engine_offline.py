"""Our engine, in process, without HTTP: the figure to set against transformers' generate_batch.

    python -m bench.engine_offline --dtype bfloat16 --num-requests 64 --concurrency 32 --max-tokens 64

Same prompts and tokenization as `bench.hf_baseline` (chat template applied by the model's
tokenizer), `ignore_eos`, greedy. The concurrency cap is `max_num_seqs`. Only the
`generate` call is timed; engine start-up (load, KV cache allocation) and a small warm-up run are
reported separately.

Engine API used (the lead's):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.types import SamplingParams
    eng = LLMEngine(EngineConfig.of(dtype="bfloat16", max_num_seqs=32))
    eng.generate(list_of_prompt_token_id_lists, SamplingParams(...)) -> list of output token id lists
"""

from __future__ import annotations

import argparse
import time

from bench.model import chat_token_ids, hf_folder
from bench.offline import OfflineResult, add_workload_args, emit, set_threads, workload


def run(args: argparse.Namespace) -> OfflineResult:
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.types import SamplingParams

    num_threads = set_threads(args)
    tokenizer = AutoTokenizer.from_pretrained(hf_folder(args.model))
    prompts = chat_token_ids(tokenizer, workload(args))

    config_kwargs: dict = {"dtype": args.dtype, "max_num_seqs": args.concurrency}
    if args.model is not None:
        config_kwargs["model"] = args.model
    if args.max_num_batched_tokens is not None:
        config_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.threads is not None:
        config_kwargs["num_threads"] = args.threads

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.of(**config_kwargs))
    load_s = time.perf_counter() - start

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    warmup_s = 0.0
    if not args.no_warmup:
        start = time.perf_counter()
        engine.generate(prompts[: min(4, len(prompts))], sampling(4))
        warmup_s = time.perf_counter() - start

    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling(args.max_tokens))
    duration_s = time.perf_counter() - start

    lengths = [len(ids) for ids in outputs]
    num_output = sum(lengths)
    notes = []
    if len(outputs) != len(prompts):
        notes.append(f"engine returned {len(outputs)} outputs for {len(prompts)} prompts")
    return OfflineResult(
        name="batchgate engine",
        dtype=args.dtype,
        num_requests=len(prompts),
        max_concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prompt_tokens=sum(len(p) for p in prompts),
        num_output_tokens=num_output,
        num_short=sum(1 for n in lengths if n < args.max_tokens) + max(0, len(prompts) - len(outputs)),
        duration_s=duration_s,
        output_tokens_per_s=num_output / duration_s,
        load_s=load_s,
        warmup_s=warmup_s,
        num_threads=num_threads,
        notes=notes,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget")
    args = parser.parse_args(argv)
    emit(run(args), args.json)


if __name__ == "__main__":
    main()
