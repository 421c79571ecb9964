package rpc

import "testing"

func TestFaultsSetAndClear(t *testing.T) {
	var f Faults
	if f.Mode("a", "b") != FaultNone {
		t.Fatal("no fault at first")
	}
	f.Set("b", FaultError)
	if got := f.Mode("a", "b"); got != FaultError {
		t.Fatalf("got %q", got)
	}
	f.Set("a", FaultReturn)
	if got := f.Mode("a", "b"); got != FaultReturn {
		t.Fatalf("the first name wins: got %q", got)
	}
	f.Set("a", FaultNone)
	f.Set("b", FaultNone)
	if len(f.Active()) != 0 || f.Mode("a", "b") != FaultNone {
		t.Fatalf("not cleared: %v", f.Active())
	}
	for _, bad := range []string{"", "Error", "slow"} {
		if _, err := ParseFaultMode(bad); err == nil {
			t.Fatalf("mode %q accepted", bad)
		}
	}
}
