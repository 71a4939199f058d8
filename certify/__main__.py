"""``python -m certify ARGS``: the ``certify`` command where no console script is installed (a
machine with the checkout on ``PYTHONPATH`` and no ``pip install``)."""

from certify.checkout import main

raise SystemExit(main())
