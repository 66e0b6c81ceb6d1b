"""The planner: everything from a profile to a scored plan, without torch (importable on a laptop).

The data's path, one module each:

* :mod:`.profile` - the profile file format (``ModelProfile``, ``LayerProfile``, load/save; a public format);
  :mod:`.analytic` - profiles from hyper-parameters for clusters you don't own;
* :mod:`.cluster`, :mod:`.problem`, :mod:`.config` (``build_problem`` from names or files) - the input;
* :mod:`.cost` - :mod:`.cost.comm` (alpha-beta collectives), :mod:`.cost.layer` (strategies and per-layer
  costs), :mod:`.cost.tables` (the per-candidate table of terms every consumer reads), :mod:`.cost.evaluate`;
* :mod:`.solver` - :mod:`.solver.backend` (python-mip plumbing), :mod:`.solver.milp` (the one MILP),
  :mod:`.solver.bounds`, :mod:`.solver.search` (the ``(pp, c)`` search), :mod:`.solver.baselines`,
  :mod:`.solver.uniform`; ``solve`` in :mod:`.solver`;
* :mod:`.plan` (the public plan format), :mod:`.report` (tables), :mod:`.viz` (figures).

Nothing is imported here, so ``import uniap_lightning.planner.plan`` stays as cheap as the module itself.
"""
