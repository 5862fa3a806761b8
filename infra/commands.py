"""Where each `astec` command lives, as "module:attribute".

Commands are imported only when run (or when `--help` lists them), so `astec --help` and the
light commands never pay for importing torch. Add one line per command; keep each area's
commands in that area's own module.
"""

COMMANDS: dict[str, str] = {
    "train": "engine.cli_train:train",
    "predict": "engine.cli_train:predict",
    "infra": "infra.cli_infra:infra",
    "simulate": "stream.simulator.cli:simulate",
    "retrain": "engine.cli_retrain:retrain",
    "stream": "stream.cli:stream",
    "data": "engine.cli_data:data",
    "evaluate": "engine.cli_evaluate:evaluate",
    "export": "engine.cli_export:export",
    "dashboard": "dashboard.cli:dashboard",
    "personalize": "personalization.cli:personalize",
    "demo": "infra.demo:demo",
}

BENCH_COMMANDS: dict[str, str] = {
    "peers": "engine.bench_peers:peers",
    "scale": "engine.bench_scale:scale",
    "stream": "stream.bench:bench_stream",
    "broker": "stream.bench_broker:bench_broker",
    "gru": "personalization.cli:bench_gru",
    "predict": "engine.bench_predict:bench_predict",
}
