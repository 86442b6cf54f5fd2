"""`make demo`: a whole fleet on this machine (coordinator, embedded broker, agents with
simulated cameras and batteries), trained by remote-triggered rounds. Not part of the
service a device or coordinator runs: it drives the real commands as a user would.

    python -m edge_agent.demo --help
"""
