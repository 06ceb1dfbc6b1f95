"""The ``pdserve`` command line and the typed client of the gateway it uses."""
