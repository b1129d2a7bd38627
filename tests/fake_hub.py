"""A Hugging Face hub on this machine (no hub is reachable from the test machines): the few routes
huggingface_hub's `create_repo` and `upload_folder` call, files sent inline ("regular" uploads), each repo's
files kept in memory. A fake of the service, not of the client: the client is the real huggingface_hub."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass
class FakeHub:
    url: str = ""
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo id -> path -> bytes
    tokens: set[str] = field(default_factory=lambda: {"hf_fake_token"})
    server: uvicorn.Server | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        def refused(request: Request) -> JSONResponse | None:
            if request.headers.get("authorization", "").removeprefix("Bearer ") not in self.tokens:
                return JSONResponse({"error": "Invalid credentials in Authorization header"}, status_code=401)
            return None

        @app.post("/api/repos/create")
        async def create(request: Request):
            if (no := refused(request)) is not None:
                return no
            body = await request.json()
            repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            if repo in self.repos:
                return JSONResponse(
                    {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}, 409
                )
            self.repos[repo] = {}
            return {"url": f"{self.url}/{repo}", "name": repo}

        @app.post("/api/validate-yaml")  # (a README.md's model card metadata, checked before a commit)
        async def validate_yaml():
            return {"errors": [], "warnings": []}

        @app.post("/api/models/{org}/{name}/preupload/{revision}")
        async def preupload(org: str, name: str, revision: str, request: Request):
            if (no := refused(request)) is not None:
                return no
            if f"{org}/{name}" not in self.repos:
                return JSONResponse({"error": "Repository not found"}, status_code=404)
            files = (await request.json())["files"]
            return {
                "files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            }

        @app.post("/api/models/{org}/{name}/commit/{revision}")
        async def commit(org: str, name: str, revision: str, request: Request):
            if (no := refused(request)) is not None:
                return no
            repo = self.repos.get(f"{org}/{name}")
            if repo is None:
                return JSONResponse({"error": "Repository not found"}, status_code=404)
            for line in (await request.body()).decode().splitlines():
                op = json.loads(line)
                if op["key"] == "file":
                    repo[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            oid = hashlib.sha1(json.dumps(sorted(repo)).encode()).hexdigest()
            return {
                "commitUrl": f"{self.url}/{org}/{name}/commit/{oid}",
                "commitOid": oid,
                "pullRequestUrl": None,
            }

        return app

    def start(self, port: int) -> FakeHub:
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning")
        )
        threading.Thread(target=self.server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake hub did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
