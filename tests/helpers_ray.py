"""A module's Ray session with one tiny checkpoint and the actors its clusters share: each
cluster adopts the actors the last one gave up (`RayCluster(actors=...)`), so the model is
loaded once per module."""

from __future__ import annotations

from helpers_models import make_tiny_model


def ray_session_with_actors(tmp_path_factory, name: str):
    """Generator for a module-scoped fixture: yields (checkpoint dir, shared actor list)."""
    import pytest
    import ray

    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path_factory.mktemp(name), "llama")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actors: list = []
    yield str(d), actors
    for a in actors:
        ray.kill(a)
    ray.shutdown()
