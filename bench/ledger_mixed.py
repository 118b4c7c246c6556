"""The ledger's exactness over a long mixed run in pool mode (issue 24): two gateways over two
replicas (the tiny model as `tiny-0` and `tiny-1`, at different prices) and one redis-server
with persistence (AOF), restarted halfway.

    python -m bench.ledger_mixed                        # 10,000 requests
    python -m bench.ledger_mixed --requests 500 --out /tmp/mixed.json

The mix (tests/pool/budget_cluster.py MIX): whole answers, streams read to the end, streams the
client cuts after 1-3 chunks, whole answers the client gives up on, requests refused before
admission (400, 404) and by the replica after it (a prompt past the context), over three tenants
(a money budget, a token budget, none). Checks (exit status 0 when all hold, 0 tokens of drift):
the ledger (the organization usage API) equals the sum of the usage events per model (one line
per admitted request), equals the tokens the replicas counted (what they sent, cut streams
included), every usage a response reported is an event as reported, and each event's cost is the
prices to the token. The tests run the same at 240 requests.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.conftest import CACHE_DIR
from tests.conftest_redis import RedisProcess
from tests.pool.budget_cluster import dump, run_mixed, start_budget_cluster
from tests.tiny_model import bundled_dir, make_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ledger-mixed-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny", bundled_dir(CACHE_DIR))
        redis = RedisProcess(work / "redis", persistent=True)
        redis.start()
        try:
            cluster = start_budget_cluster(work, model, redis.url, num_replicas=2)
            try:
                result = run_mixed(
                    cluster,
                    args.requests,
                    restart_redis=redis.restart,
                    concurrency=args.concurrency,
                    seed=args.seed,
                )
                summary = result.summary(cluster.prices)
            finally:
                cluster.stop()
        finally:
            redis.stop()
    text = dump(summary)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(summary["checks"].values()) and summary["drift_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
