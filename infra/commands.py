"""Where each `astec` command lives, as "module:attribute".

Commands are imported only when run (or when `--help` lists them), so `astec --help` and the
light commands never pay for importing torch. Add one line per command; keep each area's
commands in that area's own module.
"""

COMMANDS: dict[str, str] = {
    "train": "engine.cli_train:train",
    "predict": "engine.cli_train:predict",
    "infra": "infra.cli_infra:infra",
    "simulate": "simulator.cli_simulate:simulate",
    "retrain": "engine.cli_retrain:retrain",
    "stream": "stream.cli_stream:stream",
    "data": "engine.cli_data:data",
    "evaluate": "engine.cli_evaluate:evaluate",
    "export": "engine.cli_export:export",
    "dashboard": "dashboard.cli_dashboard:dashboard",
    "personalize": "personalization.cli_policy:personalize",
    "demo": "infra.demo:demo",
}

BENCH_COMMANDS: dict[str, str] = {
    "peers": "bench.engine_peers:peers",
    "scale": "bench.engine_scale:scale",
    "stream": "bench.stream_e2e:bench_stream",
    "broker": "bench.broker:bench_broker",
    "gru": "bench.gru_serving:bench_gru",
    "predict": "bench.engine_predict:bench_predict",
    "redis": "bench.redis_memory:bench_redis",
}

# Commands a group gains from a layer above its own: the simulator cannot import the
# personalization that trains on its traffic, so `astec simulate loop` is attached here.
SUBCOMMANDS: dict[str, dict[str, str]] = {
    "simulate": {"loop": "personalization.closed_loop:loop_cmd"},
}
