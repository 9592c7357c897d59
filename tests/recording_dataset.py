"""A dataset wrapper for tests of what the data path reads."""


class RecordingDataset:
    """Records every sample read: (index, the sorted fields asked for, or None for all)."""

    def __init__(self, dataset):
        self.dataset, self.task, self.reads = dataset, dataset.task, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.get(i)

    def get(self, i, fields=None):
        self.reads.append((i, None if fields is None else tuple(sorted(fields))))
        return self.dataset.get(i, fields)
