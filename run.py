"""The main job: ``python run.py [placement=…] [storage=…] [hook=…] [model=…] [key=value …]`` (Hydra)."""

from offload_core.runner.cli import hydra_main

if __name__ == "__main__":
    hydra_main()
