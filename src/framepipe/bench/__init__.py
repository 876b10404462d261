"""``python -m framepipe bench [core|workers|loader]``: framepipe against the stdlib and the
libraries people use, side by side in one run, as ratios.

One job a module:

``runner``
    a writer in a forked child with a watchdog, cells, calibration and repeats (``measure``)
``peers``
    who is compared: framepipe's cores, ``multiprocessing.connection``, pyzmq, and the optional
    libraries with what to install when one is missing
``rows``
    the results model: a row per measured cell, ratios against the stdlib, targets
``core``, ``detection``, ``remote``
    the core suite: framed pipes, writer-death detection, exceptions across processes
``workers``, ``loader``
    the worker pools and the data loader against their peers
``table``, ``plot``
    the text report (at most 100 columns) and the ``--plot`` bar chart
``output``, ``machine``, ``cli``
    where a report goes (the table, ``--json``, ``--plot``); what a run ran on; the command line
"""
