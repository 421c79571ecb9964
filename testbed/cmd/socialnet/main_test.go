package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestUsageErrorsExit2(t *testing.T) {
	dir := t.TempDir()
	badCfg := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(badCfg, []byte(`{"service": "text-service", "listen": "127.0.0.1:0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{},
		{"dance"},
		{"service"},
		{"service", "--config", filepath.Join(dir, "missing.json")},
		{"service", "--config", badCfg}, // text-service lacks its peers
		{"proxy", "--listen", "127.0.0.1:0"},
		{"load", "--target", "nowhere"},
		{"load", "--target", "http://127.0.0.1:1", "--mix", "home=x"},
		{"load", "--target", "http://127.0.0.1:1", "--duration", "soon"},
	} {
		var out, errOut bytes.Buffer
		if code := run(args, &out, &errOut); code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", args, code, errOut.String())
		}
		if len(args) > 0 && errOut.Len() == 0 {
			t.Errorf("%v: no message", args)
		}
	}
	var errOut bytes.Buffer
	run([]string{"service", "--config", badCfg}, &bytes.Buffer{}, &errOut)
	if !strings.Contains(errOut.String(), "url-shorten-service") {
		t.Fatalf("the error must name the missing peer: %s", errOut.String())
	}
}

func TestLoadPrintsJSONSummary(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("{}")) }))
	defer ts.Close()
	var out bytes.Buffer
	if code := run([]string{"load", "--target", ts.URL, "--rate", "50", "--duration", "0.2"}, &out, os.Stderr); code != 0 {
		t.Fatalf("exit %d", code)
	}
	var sum map[string]any
	if err := json.Unmarshal(out.Bytes(), &sum); err != nil {
		t.Fatal(err)
	}
	if sum["sent"].(float64) != 10 || sum["errors"].(float64) != 0 {
		t.Fatalf("%v", sum)
	}
}
