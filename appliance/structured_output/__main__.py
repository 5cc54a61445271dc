"""``python -m appliance.structured_output``: the trial compiles' helper process (``sandbox.CompileSandbox``)."""

from appliance.structured_output.sandbox import _helper_main

_helper_main()
