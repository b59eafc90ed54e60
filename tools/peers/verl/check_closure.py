"""Does verl's bundle resolve on the GPU host with nothing else? A CPU check of tools/peers/verl/requirements.txt.

    python3 tools/peers/verl/check_closure.py [CHUNK_DIR=.gpu/verl]     # after make-bundle.sh; pip, no network

Joins the chunks (as tests/gpu/device-install.sh does), writes a stub wheel (name and version only) for each package
host.txt leaves to the host and each one left-out.txt leaves out, and asks pip to install requirements.txt from
those wheels alone (--dry-run --no-index, CPython 3.12, manylinux x86_64): every Requires-Dist of every wheel must be
met by the bundle, the host or a named omission, at versions that satisfy it. METADATA_ONLY names the host packages
whose version a wheel's metadata refuses though the code runs on it; they are stubbed at a version the metadata takes.
Prints which stubs the resolution needed and exits non-zero when it fails.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
METADATA_ONLY = {"numpy": "2.3.5"}
"""mistral-common 1.13.1 (vLLM 0.24 and 0.32 both ask for it) declares numpy<2.4; the host has 2.5.2, on which colo's
bundle runs vLLM 0.32 with the same mistral-common."""
PLATFORMS = ("manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 "
             "manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 "
             "manylinux_2_5_x86_64 "
             "manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 any").split()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, ver = line.split("==")
            out[name.strip()] = ver.strip()
    return out


def stub(links: Path, name: str, ver: str) -> Path:
    base = f"{re.sub(r'[-.]+', '_', name)}-{ver}"
    files = {f"{base}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
             f"{base}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: peers-stub\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{base}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{base}.dist-info/RECORD,,\n"
    path = links / f"{base}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, c in files.items():
            z.writestr(p, c)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chunks = Path(argv[0] if argv else ".gpu/verl")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        parts = sorted(chunks.glob("c[0-9][0-9]/part.*"))
        if not parts:
            print(f"check_closure: no chunks in {chunks}: run tools/peers/verl/make-bundle.sh first")
            return 2
        subprocess.run(f"cat {' '.join(map(str, parts))} | tar -C {tmp} -xf -", shell=True, check=True)
        links = tmp / "wheels"
        host, left = pins(HERE / "host.txt"), pins(HERE / "left-out.txt")
        stubs = {n: METADATA_ONLY.get(n, v) for n, v in {**host, **left}.items()}
        for n, v in stubs.items():
            stub(links, n, v)
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
                            "--ignore-installed", "--find-links", str(links), "--report", str(tmp / "report.json"),
                            "--target", str(tmp / "t"), "--python-version", "3.12", "--implementation", "cp",
                            "--only-binary=:all:", *plat, "-r", str(HERE / "requirements.txt")],
                           capture_output=True, text=True)
        if r.returncode:
            print("\n".join(l for l in (r.stdout + r.stderr).splitlines() if "is ignored" not in l)[-4000:])
            print("check_closure: FAILED")
            return 1
        import json

        got = json.loads((tmp / "report.json").read_text())["install"]
        norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
        stubbed = {norm(n) for n in stubs}
        used = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in got
                      if norm(i["metadata"]["name"]) in stubbed)
        wheels = len(got) - len(used)
        print(f"check_closure: ok: {wheels} bundle wheels resolve with --no-index against {len(used)} stubs of the "
              f"host's and left-out packages: {' '.join(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
