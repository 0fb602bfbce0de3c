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

collect_ignore: list[str] = []  # integrations whose framework is not installed

for _info in pkgutil.walk_packages(gradbalance.__path__, "gradbalance."):
    if _info.name.rpartition(".")[2] != "__main__":  # pytest never collects __main__.py
        try:
            importlib.import_module(_info.name)
        except ImportError:  # an optional framework (e.g. transformers) is missing
            if not _info.name.startswith("gradbalance.integrations."):
                raise
            collect_ignore.append(f"gradbalance/{_info.name.split('.', 1)[1].replace('.', '/')}.py")
