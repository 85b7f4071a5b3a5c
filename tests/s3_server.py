"""A local S3-compatible server for tests: moto's server mode on loopback, checking signatures,
never the outside network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from mnn_rollout.local.net import free_port, wait_for

BUCKET, REGION = "models", "us-east-1"


@contextmanager
def moto_s3(workdir: Path, objects: Mapping[str, bytes]) -> Iterator[dict[str, str]]:
    """moto with IAM auth on after the setup's requests, a user allowed to read bucket ``models``,
    and ``objects`` (key: bytes) in it. Yields the environment a client needs (AWS_ENDPOINT_URL,
    AWS_REGION and the user's keys)."""
    import boto3  # moto's own dependency (the test extra)

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / "moto.log").open("wb") as out:  # the first 4 requests (the IAM setup) need no credentials
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="4"))
    try:
        wait_for(lambda: httpx.get(endpoint + "/moto-api/", timeout=1).status_code == 200, 30, "moto",
                 retry_on=(httpx.HTTPError,))
        root = {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": "setup",
                "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **root)
        iam.create_user(UserName="runtime")
        iam.put_user_policy(UserName="runtime", PolicyName="models", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="runtime")["AccessKey"]
        client = boto3.client("s3", **{**root, "aws_access_key_id": key["AccessKeyId"],
                                       "aws_secret_access_key": key["SecretAccessKey"]})
        client.create_bucket(Bucket=BUCKET)
        for name, data in objects.items():
            client.put_object(Bucket=BUCKET, Key=name, Body=data)
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": REGION, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
