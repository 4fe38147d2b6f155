"""An S3-compatible server on 127.0.0.1 for the tests: moto's server mode in a thread.

`s3_bucket()` starts one, creates a bucket and points this process's environment (and that of
every child it starts) at it through the variables botocore and s3fs read: AWS_ENDPOINT_URL
and fake credentials. The syncer reaches it as it would a cloud bucket, through s3fs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Bucket:
    url: str  # s3://<bucket>/<prefix>
    endpoint: str
    env: dict[str, str]  # what a child process needs to reach it


@contextlib.contextmanager
def s3_bucket(prefix: str = "job") -> Iterator[Bucket]:
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's filesystem points at its own server
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(name)
    try:
        yield Bucket(f"s3://{name}/{prefix}", endpoint, env)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
