"""Budget exactness in pool mode, at full size: two gateways over one redis-server and one
replica (the tiny model), N requests at once from one tenant whose hard budget holds about ten.

    python -m bench.budget_exactness                     # 500 requests (issue 24's figure)
    python -m bench.budget_exactness --requests 60 --out /tmp/exact.json

Checks, as tests/pool/test_budgets_pool.py does at 60: the settled spend never exceeds the
budget, every refusal is a 429 `insufficient_quota`, nothing stays reserved, and the spend
equals the accepted requests' `usage` times the prices, to the micro-dollar (the prices are
whole micro-dollars per token, so that is to the token). Exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.conftest import CACHE_DIR
from tests.conftest_redis import RedisProcess
from tests.pool.budget_cluster import dump, run_exactness, start_budget_cluster
from tests.tiny_model import bundled_dir, make_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--room-for", type=int, default=10, help="worst cases the budget holds (and a half)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="budget-exactness-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny", bundled_dir(CACHE_DIR))
        redis = RedisProcess(work / "redis")
        redis.start()
        try:
            cluster = start_budget_cluster(work, model, redis.url)
            try:
                result = run_exactness(cluster, "capped", args.requests, args.room_for, args.max_tokens)
            finally:
                cluster.stop()
        finally:
            redis.stop()
    summary = result.summary()
    text = dump(summary)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if result.ok and result.accepted else 1


if __name__ == "__main__":
    sys.exit(main())
