"""Benchmarks that print figures: the engine against its peers, the predictor, the stream
and the GRU policy. They may start services through infra; nothing imports them."""
