"""A loopback S3-compatible server (moto's) for the tests of checkpoints and data on S3.

The server is configured only through the standard AWS environment variables (credentials,
region, AWS_ENDPOINT_URL), which botocore and pyarrow read themselves and which a run passes on
to the rank actors because it names them in `cluster.forward_env`, as a user without an
instance role does: nothing in the package knows it is talking to a fake.
"""

from __future__ import annotations

import logging
import os

import pytest

BUCKET = "rtdt-ckpt"
# The variables the fixture sets; the ranks get only what the run names.
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server with one bucket; AWS_* point at it for the module's duration."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    # Port 0: the OS picks it as the server binds, so no other process can take it between a
    # choice and the bind (and a failed bind would leave `start` waiting forever).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    env = dict(zip(S3_ENV, ("testing", "testing", "us-east-1", f"http://127.0.0.1:{port}")))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # An S3 filesystem an earlier test of this process made (tests/unit/test_doctor_checks.py
    # checks an s3:// dir) is cached by fsspec with a client bound to real AWS: reused here, every
    # listing fails, which fsspec's `exists` reports as absent, so no commit would find its files.
    forget_s3_filesystems()
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env["AWS_ENDPOINT_URL"]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        forget_s3_filesystems()
        server.stop()


def forget_s3_filesystems() -> None:
    """fsspec caches filesystem instances (with their S3 client and its endpoint): none made
    before the fake existed may be used with it, nor one bound to the fake after it."""
    import fsspec

    fsspec.get_filesystem_class("s3").clear_instance_cache()


def remove_credentials(monkeypatch, nowhere) -> None:
    """No AWS credentials anywhere botocore (or pyarrow's AWS SDK) would look for them;
    `nowhere`: a path that does not exist."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nowhere))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
