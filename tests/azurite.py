"""Azure's blob emulator (azurite, from the npm registry) on 127.0.0.1 over real HTTP, for the tests.

A second object store with other semantics than S3: large blobs go up as staged blocks committed at
close, and there is no multipart-upload listing. ``scripts/setup_env.sh`` installs azurite into
``.venv/azurite`` (it needs Node.js). Started once per test session with in-memory storage, stopped
afterwards. adlfs (fsspec's ``abfs://``/``az://``) finds the server the way users configure it: the
``AZURE_STORAGE_CONNECTION_STRING`` environment variable.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from servers import free_port, stop, wait_until_serving

BINARY = Path(__file__).resolve().parent.parent / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
# azurite's well-known development key (public, in Azure's documentation): not a secret.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class Azurite:
    """A running ``azurite-blob`` process."""

    proc: subprocess.Popen
    endpoint: str

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={self.endpoint};")

    @property
    def env(self) -> dict[str, str]:
        """Environment that points adlfs at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def stop(self) -> None:
        stop(self.proc)


def missing() -> str | None:
    """Why azurite cannot start here (with what to do), or ``None``."""
    if shutil.which("node") is None:
        return "Node.js is not installed: run scripts/setup_env.sh (it installs nodejs and azurite)"
    if not BINARY.exists():
        return f"azurite is not installed at {BINARY}: run scripts/setup_env.sh"
    return None


def start(port: int | None = None) -> Azurite:
    """Start the blob service and wait until it answers HTTP (at most 60 s: node starts slowly here)."""
    why = missing()
    if why:
        raise RuntimeError(why)
    port = port or free_port()
    proc = subprocess.Popen([str(BINARY), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                             "--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--silent",
                             "--disableTelemetry"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    # An unsigned request gets 403: any HTTP answer means it is serving (node starts slowly here).
    wait_until_serving(proc, f"{endpoint}?comp=list", f"azurite (run {BINARY} by hand to see why)", 60)
    return Azurite(proc, endpoint)


def make_container(server: Azurite, name: str) -> None:
    """Create container ``name`` (idempotent)."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(server.connection_string) as client:
        try:
            client.create_container(name)
        except ResourceExistsError:
            pass


def committed_blocks(server: Azurite, container: str, blob: str) -> int:
    """How many committed blocks blob ``container/blob`` has (0 for one uploaded in a single PUT)."""
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(server.connection_string) as client:
        committed, _ = client.get_blob_client(container, blob).get_block_list("committed")
        return len(committed)
