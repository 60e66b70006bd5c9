"""Packaging beyond pyproject.toml: one file at the top of site-packages.

``ddpkit-engine.pth`` holds one line that the ``site`` module runs in every interpreter:
with ``DDPKIT_ENGINE=ddpkit`` set, torch's DistributedDataParallel and CPU collectives
become ddpkit's in programs started by any launcher (src/ddpkit/launcher/engine_choice.py); unset
(or ``torch``), it is one dictionary lookup. A wheel puts the files at its root in
site-packages; an editable install (``pip install -e .``) builds its wheel from the
directory given as the ``install`` command's ``install_lib``, so the file goes there in
that mode.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "ddpkit-engine.pth"
# unset or "torch": nothing imported; "ddpkit" (or a mistake, to be reported): the hook
PTH_LINE = ("import os; os.environ.get('DDPKIT_ENGINE', '') not in ('', 'torch') and "
            "__import__('ddpkit.launcher.engine_choice').launcher.engine_choice.at_interpreter_start()\n")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        with open(self._pth_path(), "w") as fh:
            fh.write(PTH_LINE)

    def _pth_path(self) -> str:
        if getattr(self, "editable_mode", False):
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        os.makedirs(target, exist_ok=True)
        return os.path.join(target, PTH_NAME)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
