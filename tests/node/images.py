"""OCI images without a registry: a static-busybox image and the pause image built from it, imported with ctr."""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from tests.node.assets import BUSYBOX, BUSYBOX_IMAGE_NAME, PAUSE_IMAGE



def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def busybox_image(path: Path, name: str = BUSYBOX_IMAGE_NAME, *, entrypoint: list[str] | None = None,
                  cmd: list[str] | None = None, files: dict[str, bytes] | None = None) -> Path:
    """Write an OCI image archive (``ctr images import`` reads it) holding Debian's static busybox
    with a symlink per applet in /bin, /etc/passwd and /etc/group, and `files` (path -> content).
    The archive's index names the image `name` (annotation io.containerd.image.name)."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, mode: int = 0o644, kind: bytes = tarfile.REGTYPE,
                link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.mode, info.type, info.linkname, info.mtime = mode, kind, link, 0
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

        for d in ("bin", "etc", "proc", "sys", "dev", "tmp", "root", "var", "run"):
            add(d, mode=0o1777 if d == "tmp" else 0o755, kind=tarfile.DIRTYPE)
        add("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)
        for applet in sorted(set(applets) - {"busybox"}):
            if "/" not in applet:
                add(f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox")
        add("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        add("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        for file_path, content in sorted((files or {}).items()):
            add(file_path.lstrip("/"), content, mode=0o755)
    layer_bytes = layer.getvalue()
    config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/bin"], "Entrypoint": entrypoint, "Cmd": cmd if cmd is not None else ["/bin/sh"],
                   "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer_bytes)]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": sha256(layer_bytes), "size": len(layer_bytes)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": manifest["mediaType"], "digest": sha256(manifest_bytes), "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as out:
        def put(member: str, data: bytes) -> None:
            info = tarfile.TarInfo(member)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            out.addfile(info, io.BytesIO(data))

        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        put("index.json", json.dumps(index).encode())
        for blob in (layer_bytes, config_bytes, manifest_bytes):
            put(f"blobs/sha256/{sha256(blob).split(':')[1]}", blob)
    return path


def pause_image(path: Path, name: str = PAUSE_IMAGE) -> Path:
    """The pod sandbox image: busybox's shell as PID 1 of the pod, waiting until SIGTERM/SIGINT
    (what registry.k8s.io/pause does; a pause process reaps nothing here, as pods do not share
    their PID namespace by default)."""
    return busybox_image(path, name, entrypoint=[
        "/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done",
    ], cmd=[])
