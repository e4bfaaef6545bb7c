# Sourced by the GPU scripts, from the repository root: the wheels the lent GPU machine lacks (put into
# the ignored .whl/ by ../shared/tools/gpu-wheels.sh, carried with the call) go into /tmp/site, and
# PYTHONPATH gets this checkout's src and them; Python's output is unbuffered so logs follow live.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
