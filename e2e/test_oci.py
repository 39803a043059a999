"""scripts/oci-package: the OCI image layout is checked here from the bytes on disk, independently of
how the script builds it: every descriptor's digest and size against its blob, the media types, the
one layer holding exactly `plugin.wasm`, and the config's diff_id against the uncompressed layer."""

from __future__ import annotations

import gzip
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path

import stack

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "oci-package"


def load_script():
    loader = importlib.machinery.SourceFileLoader("oci_package", str(SCRIPT))
    spec = importlib.util.spec_from_loader("oci_package", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def blob(layout: Path, desc: dict) -> bytes:
    algo, _, hexd = desc["digest"].partition(":")
    data = (layout / "blobs" / algo / hexd).read_bytes()
    return data


def check_layout(t: unittest.TestCase, layout: Path, wasm: bytes, tag: str) -> str:
    """Verifies a layout from scratch; returns the manifest digest."""
    t.assertEqual(json.loads((layout / "oci-layout").read_text()), {"imageLayoutVersion": "1.0.0"})
    index = json.loads((layout / "index.json").read_text())
    t.assertEqual(index["schemaVersion"], 2)
    t.assertEqual(index["mediaType"], "application/vnd.oci.image.index.v1+json")
    t.assertEqual(len(index["manifests"]), 1)
    mdesc = index["manifests"][0]
    t.assertEqual(mdesc["mediaType"], "application/vnd.oci.image.manifest.v1+json")
    t.assertEqual(mdesc["annotations"]["org.opencontainers.image.ref.name"], tag)

    referenced = set()

    def fetch(desc: dict) -> bytes:
        data = blob(layout, desc)
        t.assertEqual("sha256:" + hashlib.sha256(data).hexdigest(), desc["digest"])
        t.assertEqual(len(data), desc["size"])
        referenced.add(desc["digest"].split(":", 1)[1])
        return data

    manifest = json.loads(fetch(mdesc))
    t.assertEqual(manifest["schemaVersion"], 2)
    t.assertEqual(manifest["mediaType"], mdesc["mediaType"])
    t.assertEqual(manifest["config"]["mediaType"], "application/vnd.oci.image.config.v1+json")
    t.assertEqual(len(manifest["layers"]), 1, "one layer")
    ldesc = manifest["layers"][0]
    t.assertEqual(ldesc["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip")
    config = json.loads(fetch(manifest["config"]))
    layer = fetch(ldesc)
    tar_bytes = gzip.decompress(layer)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = tar.getmembers()
        t.assertEqual([m.name for m in members], ["plugin.wasm"])
        t.assertTrue(members[0].isfile())
        t.assertEqual(tar.extractfile(members[0]).read(), wasm)
    t.assertEqual(config["rootfs"], {"type": "layers",
                                     "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]})
    # Nothing in blobs/ that the index does not reach.
    on_disk = {p.name for p in (layout / "blobs" / "sha256").iterdir()}
    t.assertEqual(on_disk, referenced)
    return mdesc["digest"]


class OciPackage(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="oci-"))
        self.mod = load_script()
        # A small valid module: magic, version, one empty custom section.
        self.wasm = b"\0asm\x01\0\0\0" + b"\0\x05\x04test" + bytes(range(256)) * 3

    def tearDown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_layout_digests_and_media_types(self):
        self.mod.package(self.wasm, self.tmp / "a", "1.2.3")
        check_layout(self, self.tmp / "a", self.wasm, "1.2.3")

    def test_same_wasm_gives_same_digest(self):
        d1 = self.mod.package(self.wasm, self.tmp / "a", "v1")["digest"]
        d2 = self.mod.package(self.wasm, self.tmp / "b", "v1")["digest"]
        d3 = self.mod.package(self.wasm + b"\0", self.tmp / "c", "v1")["digest"]
        self.assertEqual(d1, d2)
        self.assertNotEqual(d1, d3)

    def test_refuses_what_is_not_wasm_or_a_bad_tag(self):
        with self.assertRaises(ValueError):
            self.mod.package(b"\x7fELF....", self.tmp / "x", "v1")
        with self.assertRaises(ValueError):
            self.mod.package(self.wasm, self.tmp / "x", "bad tag/../")
        self.assertFalse((self.tmp / "x").exists(), "nothing written for refused input")

    def test_cli_packages_the_built_filter(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        out = self.tmp / "cli"
        p = subprocess.run([sys.executable, str(SCRIPT), "--wasm", str(wasm), "--out", str(out),
                            "--tag", "e2e"], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        digest = check_layout(self, out, wasm.read_bytes(), "e2e")
        self.assertIn(digest, p.stdout)

    def test_cli_reports_a_missing_wasm(self):
        p = subprocess.run([sys.executable, str(SCRIPT), "--wasm", str(self.tmp / "none.wasm"),
                            "--out", str(self.tmp / "o")], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn("cannot read", p.stderr)


if __name__ == "__main__":
    unittest.main()
