"""Doctest collection of ``src/gradbalance`` (pytest's ``--doctest-modules``; not shipped).

Under ``--import-mode=importlib`` pytest imports a module it collects under its own name,
``gradbalance.step`` for ``src/gradbalance/step.py``, unless that name is already in
``sys.modules``; when the package itself is not imported yet, it imports the package first
(whose ``__init__`` imports ``gradbalance.step``) and then executes the file a second time, so
``gradbalance.TaskGradBuffer`` and ``gradbalance.step.TaskGradBuffer`` would be two classes.
Importing every module here, before collection, makes pytest reuse them all.
"""

import importlib
import pkgutil

import gradbalance

for _info in pkgutil.walk_packages(gradbalance.__path__, "gradbalance."):
    if _info.name.rpartition(".")[2] != "__main__":  # pytest never collects __main__.py
        importlib.import_module(_info.name)
