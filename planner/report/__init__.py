"""Pictures of a plan and its run: the figures' data (`figures`) and their drawing (`plots`)."""
