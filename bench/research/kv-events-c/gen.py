"""Write the C prototype's inputs from bench_routing's history, and check its view against
HeldBlocks for engine 0: python gen.py ENGINES [check] (run from this directory)."""

import random
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]  # the daemon, bench_routing

import bench_routing as br  # noqa: E402
import mooncake_proxy as mp  # noqa: E402

engines = int(sys.argv[1])
per_engine = max(2, br.EVENTS_TIMED // engines // br.EVENTS_BATCH)
per_engine -= per_engine % 2
kinds = ["stored", "removed"] * (1 + per_engine // 2) + ["step"] * (per_engine // 2)
history = br.events_history(random.Random(0), ["step", *kinds])
with open(HERE / f"prompts{engines}.bin", "wb") as f:
    for event in history.prompts:
        hashes, ids = event["block_hashes"], event["token_ids"]
        f.write(struct.pack("<II", len(hashes), br.BLOCK))
        f.write(struct.pack(f"<{len(hashes)}Q", *hashes))
        f.write(struct.pack(f"<{len(ids)}q", *ids))
code = {"stored": 0, "removed": 1, "step": 2}
with open(HERE / f"batches{engines}.bin", "wb") as f:
    for kind, payload in zip(["step", *kinds], history.batches, strict=True):
        blocks = 64 if kind == "step" else 32
        f.write(struct.pack("<III", code[kind], len(payload), blocks) + payload)
if len(sys.argv) > 2:  # after ./kvview wrote chains0.txt: the same chains as HeldBlocks?
    state = br.events_state()
    feed = mp.KvFeed("tcp://x:1", None)
    decode = mp.kv_batch_decoder()
    for seq, payload in enumerate(history.fill(0)):
        mp.take_kv_batch(state, feed, seq, decode(payload))
    for seq, payload in enumerate(history.batches, len(history.prompts)):
        mp.take_kv_batch(state, feed, seq, decode(payload))
    c = {int(line) for line in (HERE / "chains0.txt").read_text().split()}
    same = set(feed.held.chains) == c
    print("python chains", len(feed.held.chains), "C chains", len(c), "equal:", same)
