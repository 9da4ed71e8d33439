"""stppo inside verl: policy losses, search tool, data, reward, launcher and run monitor."""
