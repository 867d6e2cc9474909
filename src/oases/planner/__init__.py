"""The planner: predict a plan's step time by simulating its schedule program on costs."""
