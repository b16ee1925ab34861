"""The `uv pip install` flags that find what `pip install` finds on this machine: its indexes,
find-links folders, constraints and certificate, read from pip's own merged configuration
(`pip config list`: files and PIP_* variables). uv reads none of pip's settings itself.

Prints one flag or value a line (`xargs -d '\\n'` passes them on); .ci/run falls back to pip
when uv fails, so a setting this does not translate costs time, never a red CI.
"""

import shlex
import subprocess
import sys

# pip's precedence for `pip install`: its environment variables, then [install], then [global]
SECTIONS = (":env:", "install", "global")
MULTI = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}


def settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    found: dict[str, dict[str, str]] = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        found.setdefault(section, {})[name] = shlex.split(value)[0] if value else ""
    merged: dict[str, str] = {}
    for section in reversed(SECTIONS):  # lowest first, so the higher overwrite
        merged.update(found.get(section, {}))
    return merged


def main() -> None:
    args = ["--index-strategy", "unsafe-best-match"]  # as pip: the best version over every index
    for name, value in settings().items():
        if name == "index-url":
            args += ["--index-url", value]
        elif name == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            args.append("--no-index")
        elif name in MULTI:
            for item in value.split():
                args += [MULTI[name], item]
        elif name == "cert":
            args.append("--system-certs")  # the platform's store, where pip's cert bundle usually comes from
    print("\n".join(args))


if __name__ == "__main__":
    main()
