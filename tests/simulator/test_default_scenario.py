"""The default scenario reproduces the worlds and logs the simulator wrote before scenarios
existed, byte for byte (the digests were taken from that code on this small world)."""

import hashlib

from simulator.traffic import LogSettings, simulate_logs
from simulator.world import generate_world, save_world

# sha256 (first 40 hex digits) per file; world.json and simulation.json hold timings (and
# the scenario), so they are not compared
DIGESTS = {
    "logs/ad_clicks/2026-01-05": "0cc752248f792151d1abd927a46f1d624346d855",
    "logs/ad_clicks/2026-01-06": "d9ffe6fa8563f2270e191b9e9d788533161730dd",
    "logs/ad_impressions/2026-01-05": "223f6d7241c58b75d7d5b80e62538b06fbbc73c8",
    "logs/ad_impressions/2026-01-06": "74fcc0f3e9838164b4cca958149854a7a6d6d3a7",
    "logs/page_views/2026-01-05": "1a00d11aae1dba2feb6107b55afe2c98c1bb50f0",
    "logs/page_views/2026-01-06": "2fd0300253137b03aa62591020f6d57a6e237012",
    "logs/search_clicks/2026-01-05": "7a82182ca5ec0155a8fa7aff47f83ba2b82f3ba6",
    "logs/search_clicks/2026-01-06": "13b5b8f529c0125eb6fd1117ca8a5217c44d82e3",
    "logs/truth/intents.jsonl": "28a1abf3716986bb43fe8934fb7aeb8d3b66c06a",
    "world/pages.jsonl": "eac65014ed875e3cc9e6bb9028c50ff7e2480588",
    "world/queries.tsv": "8d7e14e945f19037dca10043d53389a56c566ff7",
    "world/subtopics.tsv": "72337457af73a84dd7b8a6969f07407756ecd48a",
    "world/truth/user_interests.jsonl": "83d76b239faf1da919ab246c81974c10947fa0bb",
    "world/users.jsonl": "a9fecafccf98c6ebaaf2a70e2b6094ac3aebae3d",
}


def test_default_world_and_logs_are_byte_identical(tmp_path):
    w = generate_world(n_queries=300, n_pages=500, n_users=60, seed=3)
    save_world(w, tmp_path / "world")
    simulate_logs(w, tmp_path / "logs", LogSettings(days=2, seed=4, search_clicks_per_day=2000))
    got = {
        str(p.relative_to(tmp_path)).removesuffix("/part-sim.jsonl"): hashlib.sha256(
            p.read_bytes()
        ).hexdigest()[:40]
        for p in sorted(tmp_path.rglob("*"))
        # the run's record and the writers' lock file (empty) are not logs
        if p.is_file() and p.name not in ("world.json", "simulation.json", ".simulate.lock")
    }
    assert got == DIGESTS
