"""Render a run's report.html in headless Chromium and save a full-page screenshot.

    python scripts/report_screenshot.py RUN_DIR [--out shot.png] [--width 1280]

Needs Debian's `chromium` (`apt-get install -y chromium`); not part of `make test`. The page
height is measured first (a Chromium window does not grow to its content), then the page
is shot at that height.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    sys.exit("error: no Chromium found; install it with `apt-get install -y chromium`")


def _run(browser: str, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=120, check=False)


def page_height(browser: str, page: Path, width: int) -> int:
    """document.body.scrollHeight, read back through the DOM Chromium dumps."""
    probe = page.with_name(".height_probe.html")
    script = ("<script>window.addEventListener('load',()=>{const d=document.createElement('p');"
              "d.id='lorapop-height';d.textContent='H='+document.documentElement.scrollHeight;"
              "document.body.appendChild(d);});</script>")
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    try:
        dom = _run(browser, f"--window-size={width},1000", "--dump-dom",
                   "--virtual-time-budget=5000", probe.as_uri()).stdout
    finally:
        probe.unlink(missing_ok=True)
    found = re.search(r"H=(\d+)", dom)
    return int(found.group(1)) if found else 4000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/report.png)")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args()
    page = args.run_dir / "report.html"
    if not page.is_file():
        sys.exit(f"error: {page} not found; run `lorapop report {args.run_dir}` first")
    browser = chromium()
    height = page_height(browser, page.resolve(), args.width)
    out = (args.out or args.run_dir / "report.png").resolve()
    res = _run(browser, f"--window-size={args.width},{height}", f"--screenshot={out}",
               "--virtual-time-budget=5000", page.resolve().as_uri())
    if not out.is_file():
        sys.exit(f"error: Chromium wrote no screenshot: {res.stderr.strip()[-500:]}")
    print(f"{out} ({args.width}x{height})")


if __name__ == "__main__":
    main()
