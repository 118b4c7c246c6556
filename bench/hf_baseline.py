"""transformers' own continuous batching (`model.generate_batch`), in process: the baseline to beat.

    python -m bench.hf_baseline --dtype bfloat16 --num-requests 64 --concurrency 32 --max-tokens 64

Same prompts as the load generator (`bench.prompts`), chat template applied. EOS is disabled
(`eos_token_id=-1`, which generate_batch reads as "no EOS") so every request produces exactly
`max_tokens` tokens, like `ignore_eos` on the servers. Greedy decoding.

The concurrency cap is `ContinuousBatchingConfig.max_requests_per_batch` (transformers 5.24:
"Maximum number of requests per batch"; the FIFO scheduler admits at most that many requests into
one forward pass). Only the `generate_batch` call is timed; model load and a small warm-up run are
reported separately. The warm-up keeps its manager (`persistent_manager=True`), so the timed call reuses
the already allocated paged cache, as a running server would.

Cache size: left to itself, transformers sizes the paged cache on CPU from 60% of *total RAM* (here
~10 GB resident and ~30 s to allocate), which changes nothing for speed on this workload (32 requests x
16 tokens: 42.5 tokens/s auto-sized vs 38.7 with 64 blocks, within the noise of a busy machine) but
takes memory from everything else on a shared machine. So by default we size it for the workload:
twice what `concurrency` requests of the longest prompt plus `max_tokens` need, in blocks of
`page_size` (256) tokens. `--num-blocks 0` restores transformers' automatic sizing.
"""

from __future__ import annotations

import argparse
import logging
import time

from bench.model import chat_token_ids, hf_folder
from bench.offline import OfflineResult, add_workload_args, emit, set_threads, workload


def run(args: argparse.Namespace) -> OfflineResult:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    num_threads = set_threads(args)
    folder = hf_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = chat_token_ids(tokenizer, workload(args))

    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    load_s = time.perf_counter() - start

    def gen_config(max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=-1,  # -1: no EOS (ignore_eos)
            pad_token_id=tokenizer.pad_token_id,
            use_cache=False,  # the continuous-batching manager keeps its own paged cache
        )

    if args.num_blocks is None:
        page_size = ContinuousBatchingConfig().page_size
        per_request = -(-(max(len(p) for p in prompts) + args.max_tokens) // page_size)
        args.num_blocks = max(16, 2 * args.concurrency * per_request)

    def cb_config() -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(
            max_requests_per_batch=args.concurrency,
            num_blocks=args.num_blocks or None,
            max_batch_tokens=args.max_batch_tokens,
        )

    warmup_s = 0.0
    if not args.no_warmup:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate_batch(
                inputs=prompts[:2],
                generation_config=gen_config(4),
                continuous_batching_config=cb_config(),
                persistent_manager=True,
            )
        warmup_s = time.perf_counter() - start

    start = time.perf_counter()
    with torch.inference_mode():
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=gen_config(args.max_tokens),
            continuous_batching_config=cb_config(),
            persistent_manager=not args.no_warmup,
        )
    duration_s = time.perf_counter() - start
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    sizing = ""
    if manager is not None:
        cfg = manager.continuous_batching_config
        sizing = f", num_blocks {cfg.num_blocks}, max_batch_tokens {cfg.max_batch_tokens}"
        model.destroy_cached_continuous_batching_manager()

    lengths = [len(out.generated_tokens) for out in outputs.values() if out.error is None]
    notes = [f"transformers {transformers.__version__}, attn {model.config._attn_implementation}{sizing}"]
    failed = len(prompts) - len(lengths)
    if failed:
        notes.append(f"{failed} requests failed or missing")
    num_output = sum(lengths)
    return OfflineResult(
        name="transformers generate_batch",
        dtype=args.dtype,
        num_requests=len(prompts),
        max_concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prompt_tokens=sum(len(p) for p in prompts),
        num_output_tokens=num_output,
        num_short=sum(1 for n in lengths if n < args.max_tokens) + failed,
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
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="paged cache blocks (default: sized for the workload; 0: transformers' auto)",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="token budget (default: auto)")
    args = parser.parse_args(argv)
    emit(run(args), args.json)


if __name__ == "__main__":
    main()
