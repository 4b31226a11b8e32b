"""TEST STAND-IN for S3: moto's S3 server (`moto[server]`, ThreadedMotoServer) on
127.0.0.1, with the bucket layout the tests need. moto speaks the S3 REST API (ListObjectsV2,
GetObject with Range and If-Match, ETags = MD5 for single-part uploads, multipart ETags,
403 InvalidAccessKeyId once authentication is switched on), so boto3 talks to it exactly as
to AWS with AWS_ENDPOINT_URL. Not modelled here: real IAM policies beyond what moto
emulates, throughput, eventual consistency.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

ACCESS_KEY = "testing"
SECRET_KEY = "testing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3StandIn:
    def __init__(self) -> None:
        self.port = _free_port()
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a client needs to reach it: the standard variables boto3 reads."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def __enter__(self) -> S3StandIn:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def _bucket(self, bucket: str) -> None:
        c = self.client()
        if bucket not in {b["Name"] for b in c.list_buckets().get("Buckets") or []}:
            c.create_bucket(Bucket=bucket)

    def put_file(self, bucket: str, key: str, path: Path) -> None:
        self._bucket(bucket)
        self.client().upload_file(str(path), bucket, key)  # multipart above 8 MB, as the AWS CLI

    def put_folder(self, bucket: str, prefix: str, folder: Path) -> None:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                self.put_file(bucket, f"{prefix}/{p.relative_to(folder)}", p)
