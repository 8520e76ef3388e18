"""The quickstart demo: `./dev demo`."""
