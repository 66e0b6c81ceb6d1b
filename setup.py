"""Ships ``uniap_lightning_autoregister.pth`` at the top of site-packages (pyproject alone cannot), so that
``Trainer(strategy="uniap")`` works without importing uniap_lightning - after a regular install (``build_py``
puts it in the wheel) and after an editable one (``pip install -e .``: ``editable_wheel`` builds a wheel of its
own that ``build_py`` outputs do not reach). ``tests/runtime/test_autoregister.py`` installs the package both ways
into fresh environments and checks the name resolves. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "uniap_lightning_autoregister.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    # Every file in the unpacked folder this hook receives goes into the editable wheel, at the top of
    # site-packages (setuptools' own namespace .pth files take the same path).
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copyfile(HERE / PTH, Path(installation_dir) / PTH)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
