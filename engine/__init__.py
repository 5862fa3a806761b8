"""Astec extreme multi-label classifier: formats, features, training, metrics, CPU predictor.

The engine knows nothing of Kafka, Redis or users; every other package may import it.
"""
