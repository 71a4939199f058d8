"""Gates: the accuracy gates a change must pass, from their files to their verdicts.

``schema`` is a gate file's and a reference file's pydantic schema; ``files`` loads both, with the
target's side of a run (``GateTarget``) and the reference store; ``stats`` the exact sign tests, their
false-fail rates and power; ``judge`` a check's verdict; ``run`` a gate's run; ``report`` its written
report and the summary; ``cli`` the ``certify gates`` command; ``plugin`` the pytest plugin that makes
every gate file a test item.
"""
