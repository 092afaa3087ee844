"""Host cost of the prefix-tree plan against the prompt plan at B=1024, P+R=32K (one thread).

    PYTHONPATH=. python benchmarks/trie_plan_cost.py

1024 rows: 64 distinct prompts of 28,672 tokens that share a 4,096-token prefix, each row with
its own 4,096-token response. Prints each plan's time (alternating, twice) and the trie's parts.
"""

import time

import torch

from zorro_core import RolloutBatch, build_dedup_plan
from zorro_core.plan import trie


def main() -> None:
    torch.set_num_threads(1)
    b, p, r, g_count, head = 1024, 28672, 4096, 64, 4096
    g = torch.Generator().manual_seed(0)
    system = torch.randint(1, 150000, (head,), generator=g)
    questions = torch.randint(1, 150000, (g_count, p - head), generator=g)
    prompts = torch.cat([system.expand(b, -1), questions[torch.arange(b) % g_count]], 1)
    responses = torch.randint(1, 150000, (b, r), generator=g)
    batch = RolloutBatch(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))
    for sharing in ("prompt", "prefix", "prompt", "prefix"):
        t = time.perf_counter()
        plan = build_dedup_plan(batch, sharing=sharing)
        print(f"{sharing:7s} plan {time.perf_counter() - t:6.2f} s  packed tokens {plan.num_tokens:,}")
    t = time.perf_counter()
    batch.validate()
    print(f"  of which validation        {time.perf_counter() - t:6.2f} s")
    t = time.perf_counter()
    canon, lens, _ = trie._rows_on_host(batch)
    print(f"  trie: rows to the host     {time.perf_counter() - t:6.2f} s")
    t = time.perf_counter()
    trie._radix_tree(canon, lens)
    print(f"  trie: sort + LCP + nodes   {time.perf_counter() - t:6.2f} s")


if __name__ == "__main__":
    main()
