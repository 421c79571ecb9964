package rpc

import (
	"fmt"
	"sync"
)

// FaultMode is what a code fault does to an operation.
type FaultMode string

// The code faults of POST /_admin/fault.
const (
	FaultNone   FaultMode = "none"   // behave normally
	FaultReturn FaultMode = "return" // answer at once with an empty, successful response
	FaultError  FaultMode = "error"  // fail: HTTP 500 and an error status on the server span
)

// ParseFaultMode checks a mode named in an admin request.
func ParseFaultMode(s string) (FaultMode, error) {
	switch m := FaultMode(s); m {
	case FaultNone, FaultReturn, FaultError:
		return m, nil
	}
	return "", fmt.Errorf("mode must be one of none, return, error; got %q", s)
}

// Faults is the switchboard of code faults of one process, keyed by operation: an HTTP route
// ("/read_posts") or a server span name ("read_posts_server").
type Faults struct {
	mu     sync.RWMutex
	active map[string]FaultMode
}

// Set turns a fault on for an operation; FaultNone turns it off.
func (f *Faults) Set(operation string, mode FaultMode) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if mode == FaultNone {
		delete(f.active, operation)
		return
	}
	if f.active == nil {
		f.active = map[string]FaultMode{}
	}
	f.active[operation] = mode
}

// Mode returns the fault of the first of names that has one, FaultNone if none has.
func (f *Faults) Mode(names ...string) FaultMode {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, n := range names {
		if m, ok := f.active[n]; ok {
			return m
		}
	}
	return FaultNone
}

// Active returns a copy of the faults that are on.
func (f *Faults) Active() map[string]FaultMode {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[string]FaultMode, len(f.active))
	for k, v := range f.active {
		out[k] = v
	}
	return out
}
