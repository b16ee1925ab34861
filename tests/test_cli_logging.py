"""The console a person reads: trimtab's own lines, not other libraries' INFO chatter (cli.main)."""

import subprocess
import sys

SCRIPT = """
import logging
from trimtab.cli import main
main(["presets"])
logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
logging.getLogger("botocore.credentials").warning("a library's warning")
logging.getLogger("trimtab.training.services.storage").info("s3://b/a holds no complete checkpoint")
"""


def test_other_libraries_info_lines_stay_off_the_console():
    """A run with checkpoint.dir s3:// said "trimtab: Found credentials in environment variables."
    (botocore's INFO, under trimtab's prefix) 3 times and "Found endpoint for s3 via:
    environment_global." 4 times. trimtab's INFO lines and every library's warnings stay."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert "Found credentials" not in done.stderr
    assert "trimtab: a library's warning" in done.stderr
    assert "trimtab: s3://b/a holds no complete checkpoint" in done.stderr
