"""edge-agent: power-budgeted int8 on-device fine-tuning for Raspberry Pi-class fleets."""

__version__ = "0.1.0"
