"""API keys reach the replicas as SHA-256 digests only, and a presented key is checked against every
digest in constant time (``app/api/keys.py``, ``deployments.launch.replica_env``)."""

from __future__ import annotations

import hashlib

import pytest

from app.api.keys import ApiKeys, digest, split_list
from deployments.launch import replica_env


def test_keys_are_held_as_digests_and_checked_against_each():
    keys = ApiKeys(["alpha", "beta"], [hashlib.sha256(b"gamma").hexdigest().upper()])
    assert keys and all(keys.accepts(k) for k in ("alpha", "beta", "gamma"))
    assert not any(keys.accepts(k) for k in ("", "alph", "alpha ", "ALPHA", digest("alpha")))
    assert "alpha" not in repr(vars(keys))
    assert not ApiKeys() and not ApiKeys([], [])
    with pytest.raises(ValueError, match="64 hex digits"):
        ApiKeys(digests=["not-a-digest"])
    assert split_list(" a, ,b ,") == ["a", "b"] and split_list(None) == []


def test_the_replicas_get_digests_never_the_keys(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FORESERVE_API_KEYS", "sk-one, sk-two")
    monkeypatch.setenv("FORESERVE_HOME", "/data/foreserve")
    monkeypatch.delenv("FORESERVE_API_KEY_SHA256", raising=False)
    env = replica_env(joined=False)
    assert "FORESERVE_API_KEYS" not in env and "sk-one" not in str(env) and env["FORESERVE_HOME"] == "/data/foreserve"
    assert env["FORESERVE_API_KEY_SHA256"].split(",") == [digest("sk-one"), digest("sk-two")]
    assert ApiKeys(digests=env["FORESERVE_API_KEY_SHA256"].split(",")).accepts("sk-two")
    joined = replica_env(joined=True)  # every node of a cluster keeps its own data dir
    assert "FORESERVE_HOME" not in joined and joined["FORESERVE_API_KEY_SHA256"] == env["FORESERVE_API_KEY_SHA256"]


def test_a_batch_jobs_environment_carries_no_ray_token(monkeypatch):
    """A job's runtime_env is shown in Ray's dashboard: the cluster's auth token never goes there (the
    job's driver runs on the cluster, whose nodes have their own)."""
    from app.runtime_env import JOB_ENV, env_vars

    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-token")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    env = env_vars(JOB_ENV)
    assert "RAY_AUTH_TOKEN" not in env and env["RAY_AUTH_MODE"] == "token"
    assert "s3cret-token" not in repr(env)
