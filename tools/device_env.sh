# Sourced by the device scripts (tools/device_fit.sh, tools/device_rows.sh): a lent GPU machine's Python
# may lack pyzmq, so a wheel in .whl/ (docs/embedded-model.md, Training) goes to /tmp/site, and the
# checkout is on the path either way.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
