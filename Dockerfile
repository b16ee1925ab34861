# A CUDA image of trimtab for clusters (`trimtab plan --emit k8s` names it trimtab:latest):
#   docker build -t trimtab:latest .
# torch is the CUDA 12.8 wheel of the version constraints.txt pins (tests/test_plan_launch.py
# checks the two agree); its CUDA libraries come with it, so a slim Python base is enough.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0
WORKDIR /opt/trimtab
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
# the extras a cluster run uses: trackers and Prometheus, per-step fault tolerance, fp8
RUN pip install -c constraints.txt -e '.[track,ft,fp8]'
WORKDIR /runs
ENTRYPOINT []
CMD ["trimtab", "--help"]
