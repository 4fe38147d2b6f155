"""The applications: the `diloco` command line and what it runs on a workstation (the local
runner, the simulator, the planner, exports, sampling) and the test kit. They stand on the base
(`diloco/`) and the three processes (`trainer/`, `syncer/`, `operator/`); nothing below imports
them (import-linter's contracts in pyproject.toml, run by `make lint`)."""
